"""The pooling tests' model: a tiny random Qwen3 saved as a Hugging Face directory (transformers writes it), with
the tests' small BPE tokenizer, compiled as an embed, a score and a generate bundle that share one export."""

from __future__ import annotations

from pathlib import Path

from helpers import compile_bundle, make_tiny_qwen3_dir, write_recipe

EOS = 0  # the tiny tokenizer's <|endoftext|>, Qwen3-Embedding's appended token
YES, NO = 9, 7  # any two ids of the 256: the score bundle's [no, yes]


def compile_pooling(root: Path, task: str, max_seq_len: int = 128, **pooling: object) -> Path:
    """The tiny model (made once under ``root``) compiled for ``task`` with ``pooling`` settings; every bundle
    uses the same model section, so the export is made once (the stage cache under ``root``)."""
    hf = root / "hf"
    if not (hf / "config.json").is_file():
        make_tiny_qwen3_dir(hf, bos_token_id=None, eos_token_id=EOS)
    name = f"{task}-{'-'.join(f'{k}{v}' for k, v in sorted(pooling.items())) or 'default'}"
    sections: dict = {"compile": {"max_seq_len": max_seq_len}, "serve": {"max_num_seqs": 16}}
    if task != "generate":
        sections |= {"task": task, "pooling": dict(pooling)}
    recipe = write_recipe(root / f"{name}.yaml", {"name": "tiny-qwen3-pool", "source": "hf", "path": "hf"},
                          **sections)
    return compile_bundle(recipe, root / name, root / "cache")
