"""The bundle: what ``omforge compile`` writes and ``omforge serve`` loads.

  manifest.json      schema version; model config; tokenizer and chat template; the step ABI (names, dtypes,
                     shapes); buckets; KV layout and block size; target; toolchain versions; file hashes
  ort/               (ort) the fused, paged, lowered step graph and its weights
  ascend/            (ascend) the lowered step graph(s), ATC commands, plugin sources, build.sh, om/ once built
  tokenizer.json

The manifest's schema is :class:`~omforge.contract.manifest.Manifest`: compile builds it, this module writes it
(``to_dict``); loading (:func:`load_manifest`, in contract/manifest.py: the runtime reads bundles without this
module) checks the schema version, every field and every listed file's size and SHA-256: an unknown version, a
missing or unknown field, a missing or a modified file is a clear :class:`BundleError`, never a crash later.
"""

from __future__ import annotations

import json
from pathlib import Path

from omforge.contract.manifest import MANIFEST, FileEntry, Manifest, file_sha256
from omforge.models.params import describe_counts


def file_entries(bundle: Path, files: list[Path]) -> dict[str, FileEntry]:
    """``{relative path: size and SHA-256}`` for the manifest."""
    return {str(f.relative_to(bundle)): FileEntry(f.stat().st_size, file_sha256(f)) for f in sorted(files)}


def write_manifest(bundle: Path, manifest: Manifest) -> None:
    (bundle / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2))


def _pooling_line(m: Manifest) -> str:
    p = m.pooling
    assert p is not None
    extra = (f", score = P(yes) over token ids {list(p.score_token_ids)} [no, yes]" if p.score_token_ids else
             f", {p.size} dimensions{', normalized' if p.normalize else ''}{', matryoshka' if p.matryoshka else ''}")
    return (f"  pooling    task {p.task}, {p.pooling}-token pooling of output {p.output}{extra}, prompt format "
            f"{p.prompt_format}; no KV pool")


def _layer_of(name: str) -> int | None:
    """The layer of a per-layer ABI name (``key_cache.N``, ``lora_a.N.qkv``), else None."""
    parts = name.split(".")
    if parts[-1].isdigit():
        return int(parts[-1])
    if parts[0] in ("lora_a", "lora_b") and len(parts) == 3 and parts[1].isdigit():
        return int(parts[1])
    return None


def describe(m: Manifest) -> str:
    """A readable summary for ``omforge inspect``."""
    cfg, kv, limits = m.model.config, m.kv, m.limits
    lines = [
        f"bundle of {m.model.name} ({cfg.family}), target {m.target}, schema {m.schema_version}",
        f"  model      {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, head_dim {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, tied embeddings {cfg.tie_word_embeddings}",
        f"  parameters {describe_counts(cfg)}",
        f"  kv cache   block size {kv.block_size}, layout {kv.layout}, {kv.num_layers} layers × K,V, "
        f"{kv.bytes_per_token} bytes per token" if kv is not None else _pooling_line(m),
        f"  limits     max_seq_len {limits.max_seq_len}, max_batch_size {limits.max_batch_size}, max_num_tokens "
        f"{limits.max_num_tokens}",
        (f"  attention  paged attention lowered to {m.paged_attention}" if kv is not None else
         "  attention  causal, within each step's whole sequences")
        + (f" (needs kernel library {m.kernels.domain} ABI {m.kernels.abi}, compiled with ISA path "
           f"{m.kernels.isa})" if m.kernels else ""),
        "  fusions    " + ", ".join(f"{k} {v}" for k, v in m.passes.fusion_counts.items()),
        "  graphs     " + ", ".join(f"{k}: {v}" for k, v in m.graphs.to_dict().items()),
        f"  tokenizer  {m.tokenizer.file}, chat template {'yes' if m.tokenizer.chat_template else 'no'}, "
        f"eos {list(cfg.eos_token_ids)}",
        "  step ABI",
    ]
    for io, entries in (("input", m.abi.inputs), ("output", m.abi.outputs)):
        for e in entries:
            layer = _layer_of(e.name)
            if layer not in (None, 0):
                continue
            more = " (… one per layer)" if layer == 0 else ""
            shape = list(e.shape) if e.shape is not None else None
            lines.append(f"    {io:6s} {e.name:22s} {e.dtype or '?':7s} {shape}{more}")
    if m.lora:
        lora = m.lora
        lines.append(f"  lora       {lora.max_loras} adapter slots (+ the base model's), rank {lora.max_rank}, targets "
                     f"{', '.join(lora.target_modules)}; {len(lora.projections)} projections: "
                     + ", ".join(dict.fromkeys(p.name for p in lora.projections)))
    lines.append("  buckets    " + json.dumps(m.buckets.to_dict()))
    if m.ascend:
        asc, mem = m.ascend, m.ascend.memory
        lines.append(f"  ascend     OM {asc.model}*.om ({asc.atc}), SoC {asc.soc_version}, {len(asc.gears)} gears "
                     f"over {', '.join(asc.gear_dims)}, pool {asc.num_slots} slots")
        lines.append("  device mem " + ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in (
            ("weights", mem.weights_bytes), ("kv_pool", mem.kv_pool_bytes), ("io", mem.io_bytes),
            ("workspace_estimate", mem.workspace_bytes_estimate), ("total", mem.total_bytes))))
        lines.append(f"  load       {mem.load}")
    lines.append("  toolchain  " + ", ".join(f"{k} {v}" for k, v in m.toolchain.items()))
    size = sum(e.size for e in m.files.values())
    lines.append(f"  files      {len(m.files)} files, {size / 1e6:.1f} MB")
    return "\n".join(lines)
