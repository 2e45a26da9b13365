"""Greedy generation over the unfused export with onnxruntime: the smoke path, full recompute, no KV cache.

Each step runs the whole sequence again and takes the argmax of the last row: O(n²) work, kept only as
the simplest correct reference (the paged engine replaces it for serving).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from omforge.contract.manifest import ModelConfig, TokenizerMeta
from omforge.errors import OmforgeError
from omforge.runtime.tokenizer import TextTokenizer


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) or "length"
    seconds: float


class ExportedModel:
    """An export directory (model.onnx + export.json [+ tokenizer.json]) loaded into one ORT session."""

    def __init__(self, export_dir: Path, threads: int | None = None):
        meta_path = export_dir / "export.json"
        if not meta_path.is_file():
            raise OmforgeError(f"{export_dir}: not an omforge export (no export.json)")
        self.export_dir = export_dir
        self.meta = json.loads(meta_path.read_text())
        self.config = ModelConfig.from_dict(self.meta["config"], "config")
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(export_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        tok = TokenizerMeta.from_dict(self.meta["tokenizer"], f"{meta_path}: tokenizer")
        self.tokenizer = TextTokenizer(export_dir / tok.file, tok) if tok.file else None

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Full-sequence logits ``[batch, seq, vocab]`` for ``input_ids [batch, seq]`` (positions 0..seq-1)."""
        positions = np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int64), input_ids.shape)
        return self.session.run(None, {"input_ids": input_ids.astype(np.int64),
                                       "position_ids": np.ascontiguousarray(positions)})[0]

    def greedy(self, prompt_ids: Sequence[int], max_tokens: int, ignore_eos: bool = False) -> Generation:
        if not prompt_ids:
            raise OmforgeError("the prompt is empty")
        limit = self.config.max_position_embeddings
        if len(prompt_ids) + max_tokens > limit:
            raise OmforgeError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                               f"model's context of {limit} tokens")
        t0 = time.perf_counter()
        ids = list(prompt_ids)
        out: list[int] = []
        eos = set(self.config.eos_token_ids)
        reason = "length"
        for _ in range(max_tokens):
            nxt = int(self.logits(np.array([ids]))[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt in eos and not ignore_eos:
                reason = "stop"
                break
        text = self.tokenizer.decode(out) if self.tokenizer else ""
        return Generation(out, text, reason, time.perf_counter() - t0)
