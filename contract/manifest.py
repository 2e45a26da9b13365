"""The bundle's manifest as the runtime reads it: schema version, and :func:`load_manifest`, which checks it and
every listed file's size and SHA-256. Writing bundles is compile/bundle.py's job (it imports these).
Dependency-free: stdlib and omforge.errors only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omforge.errors import OmforgeError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class BundleError(OmforgeError):
    """A bundle that cannot be used: the message names the bundle and the file or field."""


def load_manifest(bundle: Path, verify: bool = True) -> dict[str, Any]:
    """Read and check a bundle's manifest. ``verify`` re-hashes every listed file (about a second per GB)."""
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a directory (expected a bundle written by omforge compile)")
    if not path.is_file():
        raise BundleError(f"{bundle}: no {MANIFEST} (not a bundle, or its compile did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(f"{path}: schema_version {version!r} is not supported by this omforge "
                          f"(supports {SCHEMA_VERSION}); recompile the bundle")
    for rel, entry in manifest.get("files", {}).items():
        f = bundle / rel
        if not f.is_file():
            raise BundleError(f"{bundle}: file '{rel}' listed in the manifest is missing")
        if f.stat().st_size != entry["size"]:
            raise BundleError(f"{bundle}: file '{rel}' was modified (size {f.stat().st_size}, manifest says "
                              f"{entry['size']}); recompile the bundle")
        if verify and file_sha256(f) != entry["sha256"]:
            raise BundleError(f"{bundle}: file '{rel}' was modified (SHA-256 differs from the manifest); "
                              f"recompile the bundle")
    return manifest


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
