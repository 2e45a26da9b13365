"""``omforge diff``, numerics: A and B run with ONNX Runtime on the same random tokens; max abs error, relative
error (max abs error over max |A|, normwise, so near-zero logits do not blow it up) and top-1 agreement per output.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from omforge.diff.types import DiffOptions, OutputDrift
from omforge.errors import OmforgeError, one_line

if TYPE_CHECKING:
    import onnxruntime


class Runner:
    """A's session and outputs on the fixed inputs, to compare any number of B graphs against (their
    interfaces checked by :func:`check_interfaces`)."""

    def __init__(self, a_path: Path, options: DiffOptions):
        session = session_for(a_path)
        self.feeds = feeds(a_path, session, options)
        self.names = [o.name for o in session.get_outputs()]
        self.outputs = session.run(None, self.feeds)

    def compare(self, b_path: Path) -> list[OutputDrift]:
        session = session_for(b_path)
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, self.feeds)))
        return [drift(name, ref, got[name]) for name, ref in zip(self.names, self.outputs)]


def session_for(path: Path) -> onnxruntime.InferenceSession:
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OmforgeError(f"{path}: ONNX Runtime cannot load it ({one_line(e)})") from None


def feeds(path: Path, session, options: DiffOptions) -> dict[str, np.ndarray]:  # noqa: ANN001
    vocab = session.get_outputs()[0].shape[-1]
    if not isinstance(vocab, int):
        raise OmforgeError(f"{path}: the vocabulary size (last dimension of {session.get_outputs()[0].name}) "
                           "is not static")
    rng = np.random.default_rng(options.seed)
    ids = rng.integers(0, vocab, size=(options.batch, options.seq), dtype=np.int64)
    positions = np.ascontiguousarray(np.broadcast_to(np.arange(options.seq, dtype=np.int64), ids.shape))
    return {"input_ids": ids, "position_ids": positions}


def drift(name: str, ref: np.ndarray, got: np.ndarray) -> OutputDrift:
    if ref.shape != got.shape:
        raise OmforgeError(f"output {name}: A gives shape {list(ref.shape)}, B gives {list(got.shape)}")
    r, g = ref.astype(np.float64), got.astype(np.float64)
    max_abs = float(np.max(np.abs(r - g))) if r.size else 0.0
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    if r.ndim >= 2 and r.shape[-1] > 1:
        agree = int(np.sum(r.argmax(-1) == g.argmax(-1)))
        rows = int(np.prod(r.shape[:-1]))
    else:
        agree = rows = 0
    return OutputDrift(name, list(ref.shape), max_abs, max_rel, agree, rows)

