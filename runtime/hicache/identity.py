"""What a tier's block belongs to: the bundle identity every stored block is keyed by.

A block of KV is only valid for the model, weights, KV dtype and layout that computed it. The identity is the
SHA-256 of exactly those facts — the model name and config, the SHA-256 of every bundle file (graphs and weights:
a requantized or recompiled bundle is another identity), the target, and the paged layout — so two bundles share
stored blocks only when they would compute the same KV. Tier keys are ``(identity, block hash)``, the block hash
being the pool's prefix-hash chain (``kv_cache_manager.hash_block_tokens``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from omforge.contract import KV_ITEMSIZE
from omforge.contract.manifest import Manifest

FORMAT_VERSION = 1  # of the stored block (block_file.py); part of the identity so a format change is a miss


@dataclass(frozen=True)
class BlockLayout:
    """One block's bytes in the pools: ``num_pools`` arrays (every layer's K then V), each holding
    ``pool_block_bytes`` contiguous bytes per block (``block_size x kv_heads x row_elems`` of ``kv_dtype``)."""

    block_size: int
    num_layers: int
    kv_heads: int
    row_elems: int
    kv_dtype: str
    itemsize: int

    @property
    def num_pools(self) -> int:
        return 2 * self.num_layers

    @property
    def pool_block_bytes(self) -> int:
        return self.block_size * self.kv_heads * self.row_elems * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_pools * self.pool_block_bytes

    def describe(self) -> dict:
        return {"block_size": self.block_size, "num_layers": self.num_layers, "kv_heads": self.kv_heads,
                "row_elems": self.row_elems, "kv_dtype": self.kv_dtype, "pool_block_bytes": self.pool_block_bytes}


@dataclass(frozen=True)
class BundleIdentity:
    """``digest``: 32 bytes naming the bundle's KV (module docstring); ``model``: its name, for logs and headers."""

    digest: bytes
    model: str
    layout: BlockLayout

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def of(cls, manifest: Manifest) -> BundleIdentity:
        kv = manifest.kv
        layout = kv.paged_layout
        block = BlockLayout(kv.block_size, kv.num_layers, kv.kv_heads, layout.row_elems, kv.dtype,
                            KV_ITEMSIZE[kv.dtype])
        facts = {"format": FORMAT_VERSION, "model": manifest.model.name, "config": manifest.model.config.to_dict(),
                 "target": manifest.target, "files": {p: f.sha256 for p, f in sorted(manifest.files.items())},
                 "layout": block.describe()}
        digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).digest()
        return cls(digest, manifest.model.name, block)
