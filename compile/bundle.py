"""The bundle: what ``omforge compile`` writes and ``omforge serve`` loads.

  manifest.json      schema version; model config; tokenizer and chat template; the step ABI (names, dtypes,
                     shapes); buckets; KV layout and block size; target; toolchain versions; file hashes
  ort/               (ort) the fused, paged, lowered step graph and its weights
  ascend/            (ascend) the lowered step graph(s), ATC commands, plugin sources, build.sh, om/ once built
  tokenizer.json

Loading (:func:`load_manifest`, in contract/manifest.py: the runtime reads bundles without this module) checks
the schema version and every listed file's size and SHA-256: an unknown version, a missing or a modified file
is a clear :class:`BundleError`, never a crash later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omforge.contract.manifest import MANIFEST, SCHEMA_VERSION, file_sha256


def file_entries(bundle: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    """``{relative path: {size, sha256}}`` for the manifest."""
    return {str(f.relative_to(bundle)): {"size": f.stat().st_size, "sha256": file_sha256(f)} for f in sorted(files)}


def write_manifest(bundle: Path, manifest: dict[str, Any]) -> None:
    manifest = {"schema_version": SCHEMA_VERSION, **manifest}
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=2))


def describe(manifest: dict[str, Any]) -> str:
    """A readable summary for ``omforge inspect``."""
    cfg = manifest["model"]["config"]
    kv = manifest["kv"]
    lines = [
        f"bundle of {manifest['model']['name']} ({cfg['family']}), target {manifest['target']}, "
        f"schema {manifest['schema_version']}",
        f"  model      {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, heads "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} kv, head_dim {cfg['head_dim']}, "
        f"vocab {cfg['vocab_size']}, tied embeddings {cfg['tie_word_embeddings']}",
        f"  kv cache   block size {kv['block_size']}, layout {kv['layout']}, {kv['num_layers']} layers × K,V, "
        f"{kv['bytes_per_token']} bytes per token",
        f"  limits     max_seq_len {manifest['limits']['max_seq_len']}, max_batch_size "
        f"{manifest['limits']['max_batch_size']}, max_num_tokens {manifest['limits']['max_num_tokens']}",
        f"  attention  paged attention lowered to {manifest.get('paged_attention', 'plain')}"
        + (f" (needs kernel library {manifest['kernels']['domain']} ABI {manifest['kernels']['abi']}, "
           f"compiled with ISA path {manifest['kernels']['isa']})" if manifest.get("kernels") else ""),
        "  fusions    " + ", ".join(f"{k} {v}" for k, v in manifest["passes"]["fusion_counts"].items()),
        "  graphs     " + ", ".join(f"{k}: {v}" for k, v in manifest["graphs"].items()),
        f"  tokenizer  {manifest['tokenizer'].get('file')}, chat template "
        f"{'yes' if manifest['tokenizer'].get('chat_template') else 'no'}, eos {cfg['eos_token_ids']}",
        "  step ABI",
    ]
    for io in ("inputs", "outputs"):
        entries = manifest["abi"][io]
        shown = [e for e in entries if not e["name"].split(".")[-1].isdigit() or e["name"].endswith(".0")]
        for e in shown:
            more = " (… one per layer)" if e["name"].endswith(".0") else ""
            lines.append(f"    {io[:-1]:6s} {e['name']:22s} {e['dtype']:7s} {e['shape']}{more}")
    lines.append("  buckets    " + json.dumps(manifest["buckets"]))
    asc = manifest.get("ascend")
    if asc:
        mem = asc.get("memory") or {}
        lines.append(f"  ascend     OM {asc['model']}*.om ({asc['atc']}), SoC {asc['soc_version']}, "
                     f"{len(asc['gears'])} gears over {', '.join(asc['gear_dims'])}, pool {asc['num_slots']} slots")
        if mem:
            lines.append("  device mem " + ", ".join(f"{k.removesuffix('_bytes')} {mem[k] / 2**20:.1f} MiB" for k in (
                "weights_bytes", "kv_pool_bytes", "io_bytes", "workspace_bytes_estimate", "total_bytes")))
    lines.append("  toolchain  " + ", ".join(f"{k} {v}" for k, v in manifest["toolchain"].items()))
    size = sum(e["size"] for e in manifest["files"].values())
    lines.append(f"  files      {len(manifest['files'])} files, {size / 1e6:.1f} MB")
    return "\n".join(lines)
