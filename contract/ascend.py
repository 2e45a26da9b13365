"""What the ascend compile stage and the ACL executor share: the OM's file naming, the paged-attention modes and
the names of their pools and step inputs, and the input ATC adds to a gear model. Dependency-free (stdlib only).

Paged-attention modes (``compile.paged_attention``; docs/ascend-paged-attention.md):

- ``inplace``: per-layer pools ``key_cache.N`` / ``value_cache.N`` declared ``RefData`` in the OM; each layer writes
  the step's K/V rows into them (ScatterPaKvCache, or ScatterNdUpdate on 310P) and a paged kernel reads them
  (FusedInferAttentionScore, or IncreFlashAttention on 310P) with the block table. No new-rows output, no copy.
- ``readonly``: the same pools as plain inputs, read by FIA as they were before the step (with its LSE); the step's
  own rows are attended separately and merged; the graph returns ``kv_new`` and the executor writes it in place.
- ``gather``: one interleaved pool ``kv_cache`` gathered into a padded context per layer; ``kv_new`` copied by
  the executor (the path every SoC can run).
"""

from __future__ import annotations

import glob
from pathlib import Path

OM_MODEL = "step"
"""The one OM of an ascend bundle (its gears cover prefill and decode: the weights are on the device once)."""
KV_POOL, KV_NEW = "kv_cache", "kv_new"
"""The gather mode's pool input ``[num_slots, num_layers, 2, kv_heads, head_dim]`` and the new rows
``[num_tokens, …]``."""

PAGED_ATTENTION_MODES = ("inplace", "readonly", "gather")
"""``compile.paged_attention``; ``auto`` in a recipe picks ``inplace`` where the SoC's kernels ship, else
``gather`` (passes/ascend/kernels.py)."""


def key_cache(layer: int) -> str:
    """Layer ``layer``'s K pool input of the in-place and read-only modes: ``[num_blocks, block_size, kv_heads,
    head_dim]`` (one slot = ``block * block_size + offset`` is one row of ``kv_heads · head_dim`` elements)."""
    return f"key_cache.{layer}"


def value_cache(layer: int) -> str:
    """Layer ``layer``'s V pool input (as :func:`key_cache`)."""
    return f"value_cache.{layer}"


SLOT_MAPPING = "slot_mapping"
"""``[num_tokens]`` int32: the pool slot each token's K/V row is written to. ScatterPaKvCache requires the slots
unique and in range, so a gear's padding rows get distinct scratch slots (:data:`SCRATCH_BLOCKS_NOTE`)."""
SEQ_LENS_Q, SEQ_LENS_KV = "actual_seq_lengths", "actual_seq_lengths_kv"
"""``[num_seqs]`` int64: each sequence's query tokens in this run and its context length after the step's write
(FIA / IFA ``actual_seq_lengths`` / ``actual_seq_lengths_kv``; a padding sequence has 1 and 1)."""
SCRATCH_BLOCKS_NOTE = ("the pool's last blocks are scratch: the padding rows of a gear are written there, never "
                       "handed to the block pool")
REF_SUFFIX = ".ref"
"""Twin graphs only (the plain-op graph the tests' FAKE pyACL runs): an output ``<input>.ref`` is the value a ref op
wrote into input ``<input>``. The OM has no such output (a pool alias reaching NetOutput gets a copy, hicann/ge
``mem_layout_conflict_util.cc:1246-1251``); the fake applies it to the caller's buffer when the OM declares that
input ``RefData`` and drops it otherwise (``inner_identity_add_pass.cc:30-60, 95-104``)."""
CANN_RELEASE = "9.1.0"
"""The CANN release the ascend path targets: the newest release (tag ``v9.1.0``, 2026-07-21, in hicann/ge, ops-nn and
ops-math) of the open-sourced hicann repositories whose sources docs/ascend-conformance.md cites. Those sources are
partly newer than it: hicann/ge ffdcbc9 (2026-08-21) is the 9.2.0 development line (``version.cmake``), ops-nn
e5c3fa9 and ops-math c419332 (2026-08-22) still declare 9.1.0; the ops-transformer snapshot c29bc10 (2025-11-15) is
older (8.5.0.alpha001). ``omforge doctor`` and ``build.sh`` say when the installed toolkit is older."""
DYNAMIC_INPUT = "ascend_mbatch_shape_data"
"""The input ATC adds to a gear model (ACL_DYNAMIC_TENSOR_NAME, reference/ascend.md §3.4): allocated, never written."""


class OmNameClash(ValueError):
    """Several OM files match one ATC ``--output`` prefix (a stale build beside a new one)."""


def find_om(prefix: Path) -> Path | None:
    """The .om ATC wrote for ``--output=<prefix>``: ``<prefix>.om`` or ``<prefix>_<os>_<cpu>.om`` (the suffix comes
    with dynamic-shape parts: hicann/ge ``model_helper.cc``, reference §5.1). None when there is none;
    :class:`OmNameClash` when several match."""
    prefix = Path(prefix)
    found = sorted(p for p in prefix.parent.glob(f"{glob.escape(prefix.name)}*.om")
                   if p.name == f"{prefix.name}.om" or p.name.startswith(f"{prefix.name}_"))
    if len(found) > 1:
        raise OmNameClash(f"{prefix}: several OM files match {prefix.name}*.om "
                          f"({', '.join(p.name for p in found)}); remove the stale ones")
    return found[0] if found else None
