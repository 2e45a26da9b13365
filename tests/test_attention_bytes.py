"""The attention bytes ``omforge inspect`` prints (runtime/ascend/attention_bytes.py), against the counts of
docs/ascend-paged-attention.md §4 and issue 60's acceptance: an 8B-shaped 910B float16 in-place bundle reads within
1.1× of the paged floor at batch 32 and 4k context, readonly too, the gather one ~19×. Arithmetic only: nothing
was measured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omforge.runtime.ascend.attention_bytes import AttentionShape, inspect_line, paged_floor, step_bytes

MIB = 2**20


def manifest(mode: str, layers: int = 32, q: int = 32, kv: int = 8, d: int = 128, dtype: str = "float16",
             block: int = 128) -> SimpleNamespace:
    """The manifest fields the count reads, shaped like a compiled bundle's (no 8B compile needed)."""
    return SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(num_attention_heads=q)),
        kv=SimpleNamespace(num_layers=layers, kv_heads=kv, head_dim=d, dtype=dtype, block_size=block),
        ascend=SimpleNamespace(paged_attention=mode, soc_version="Ascend910B3"))


def test_the_gather_count_is_the_docs_table() -> None:
    """docs/ascend-paged-attention.md §4 (14E + 6gE + …: the Concat of the step's rows copies the context): Llama-3-8B
    at batch 32 / 4k is 9,804 MiB per layer against a 512 MiB floor (19.1×), SmolLM2 at batch 1 / 1k 12.2 MiB
    against 0.75 MiB (16.3×)."""
    llama = AttentionShape.of(manifest("gather"))
    assert paged_floor(llama, 32, 4096) == 32 * 512 * MIB
    assert round(step_bytes("gather", llama, 32, 4096) / 32 / MIB) == 9804
    smol = AttentionShape.of(manifest("gather", layers=30, q=9, kv=3, d=64))
    assert round(step_bytes("gather", smol, 1, 1024) / 30 / MIB, 1) == 12.2
    assert round(step_bytes("gather", smol, 1, 1024) / paged_floor(smol, 1, 1024), 1) == 16.3


def test_an_8b_in_place_bundle_reads_within_1_1x_of_the_floor_and_gather_19x() -> None:
    for mode, low, high in (("inplace", 1.0, 1.1), ("readonly", 1.0, 1.1), ("gather", 18.5, 19.5)):
        m = manifest(mode)
        ratio = step_bytes(mode, AttentionShape.of(m), 32, 4096) / paged_floor(AttentionShape.of(m), 32, 4096)
        assert low <= ratio <= high, (mode, ratio)
        line = inspect_line(m, 32, 4096)
        assert f"{mode}:" in line and f"{ratio:.2f}×" in line and "16,384 MiB" in line and "\n" not in line


def test_a_context_off_the_block_pays_for_the_whole_last_block() -> None:
    shape = AttentionShape.of(manifest("inplace"))
    assert step_bytes("inplace", shape, 1, 4097) > step_bytes("inplace", shape, 1, 4096) * 1.03
    with pytest.raises(ValueError, match="'paged' has no count"):
        step_bytes("paged", shape, 1, 1)
    assert "not counted" in inspect_line(manifest("paged"), 32, 4096)


def test_readonly_reads_the_floor_plus_the_steps_rows_and_their_copy() -> None:
    """Readonly = in place + the LSE (8·B·Hq) + the step's rows read, written as kv_new and copied (8 rows per
    sequence, against in place's 4): for the 8B shape at batch 32 / 4k, 32 layers × (4·32·2 KiB + 8·32·32) more."""
    shape = AttentionShape.of(manifest("readonly"))
    extra = step_bytes("readonly", shape, 32, 4096) - step_bytes("inplace", shape, 32, 4096)
    assert extra == 32 * (4 * 32 * 8 * 128 * 2 + 8 * 32 * 32)
