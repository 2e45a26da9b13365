"""What the ascend compile stage and the ACL executor share: the OM's file naming, the names of the step graph's
one KV pool and its new-rows output, and the input ATC adds to a gear model. Dependency-free (stdlib only)."""

from __future__ import annotations

import glob
from pathlib import Path

OM_MODEL = "step"
"""The one OM of an ascend bundle (its gears cover prefill and decode: the weights are on the device once)."""
KV_POOL, KV_NEW = "kv_cache", "kv_new"
"""The pool input ``[num_slots, num_layers, 2, kv_heads, head_dim]`` and the new rows ``[num_tokens, …]``."""
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
