"""The contract between compile and the runtime: the step ABI's names, the fusion switches, the KV pool layout,
block-size defaults (here), the manifest's schema and reader (:mod:`omforge.contract.manifest`), the bucket
plan (:mod:`omforge.contract.buckets`), the kernel library's op contract (:mod:`omforge.contract.kernel_abi`)
and the speculative decoding configuration (:mod:`omforge.contract.speculative`).

Dependency-free (stdlib and omforge.errors only), so that serving a bundle never imports the graph tooling
(onnx_ir, onnxscript, torch) that produces it. ``passes/paged_kv.py`` builds graphs with this ABI (its docstring
has the full table of inputs and outputs; docs/compile.md has it too); ``runtime/`` packs steps for it and allocates
pools by it.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSIONS = ("rms_norm", "add_rms_norm", "rotary", "qkv_merge", "moe", "gate_up_swiglu", "attention")
"""Fusion switches (recipe ``compile.fusions``), in pass order: omforge's own passes, whose counts the manifest
records under these names (never sent to ATC). ``moe`` matches only mixtures of experts (0 on a dense model)."""

DEFAULT_BLOCK_SIZE = {"ort": 64, "ascend": 128}
"""Tokens per KV block by target. ascend: 128, what MindIE and vllm-ascend use and IFA recommends. ort: 64, the
block size measured best for the plain lowering (benchmarks/RESULTS.md, "block size")."""

STEP_INPUTS = ("input_ids", "position_ids", "slot_mapping", "block_tables", "query_index", "token_index",
               "logits_indices")
DECODE_GROUP_INPUTS = ("decode_block_tables", "decode_query_index")
"""The ORT lowering's second group (``lower_ort``): ``decode_block_tables [Bd, Md]`` and ``decode_query_index
[Bd, 1]`` — sequences with one query each, attended apart from the main group; ``token_index`` then indexes the
rows ``[B * Q + Bd]`` (main group first). A step without such a split sends a group of one unreferenced row."""

KV_DTYPES = ("float32", "bfloat16", "int8")
"""KV pool element types (recipe ``compile.kv_cache_dtype``). bfloat16 and int8 need omforge's CPU kernel.
(An ascend bundle built with ``compile.weights: float16`` or ``int8`` has float16 pools: its graph is float16.)
int8 is symmetric per token and KV head (MindIE's C8): each head's row holds ``head_dim`` int8 values followed
by its float32 scale (4 bytes), so the pool's last dimension is ``head_dim + 4``."""
KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
"""Bytes of one pool element by KV dtype (bfloat16 pools are uint16 arrays; float16: an ascend float16 graph's)."""


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for non-negative ``a`` and positive ``b`` (blocks for ``a`` tokens, panels for ``a``
    columns, …)."""
    return -(-a // b)


@dataclass(frozen=True)
class PagedLayout:
    """What the runtime needs to allocate and bind the pools: per layer, K and V pools
    ``[num_blocks, block_size, kv_heads, row_elems]`` of ``kv_dtype``."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str = "float32"

    @property
    def row_elems(self) -> int:
        """Elements of one head's row in the pool (int8: the values, then the scale's 4 bytes)."""
        return row_elems(self.head_dim, self.kv_dtype)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in every layer's K and V pools together."""
        return 2 * self.num_layers * self.kv_heads * self.row_elems * KV_ITEMSIZE[self.kv_dtype]


def row_elems(head_dim: int, kv_dtype: str) -> int:
    """Elements of one head's row in a ``kv_dtype`` pool: ``head_dim``, plus 4 bytes of scale for int8."""
    return head_dim + 4 if kv_dtype == "int8" else head_dim
