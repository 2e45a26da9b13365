"""One KV block as a file: a header naming what it is, then the block's bytes in every pool, checksummed.

Layout: ``MAGIC`` (8 bytes), the header's length (u32, little endian), the header (JSON: format, bundle
identity, model, block hash, :class:`~omforge.runtime.hicache.identity.BlockLayout`, payload bytes, CRC-32 of the
payload), then the payload: each pool's bytes of the block in pool order (every layer's K, then V). A reader
accepts a file only if every header field matches what it expects and the payload has exactly the stated size
and checksum; anything else is a :class:`BadBlock` naming the reason, and the destination bytes must then be
treated as garbage. Writers write a private temporary file in the same directory and rename it over the final
name (atomic on POSIX), so a reader sees a whole file or none, and concurrent writers of one block leave one
whole file (each holds the same prefix's KV from the same bundle).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from omforge.runtime.hicache.identity import FORMAT_VERSION, BundleIdentity

MAGIC = b"OMKVBLK\x01"
_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 16


class BadBlock(Exception):
    """A block file that must not be used; ``reason`` is one word (truncated, corrupt, foreign, unreadable);
    ``inode``: ``(st_dev, st_ino)`` of the file that was read, so that only that file is deleted, never one another
    replica renamed over its name since."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.inode: tuple[int, int] | None = None


def _header(identity: BundleIdentity, block_hash: bytes, crc: int) -> bytes:
    layout = identity.layout
    return json.dumps({"format": FORMAT_VERSION, "identity": identity.hex, "model": identity.model,
                       "block_hash": block_hash.hex(), "layout": layout.describe(),
                       "payload_bytes": layout.block_bytes, "crc32": crc}, sort_keys=True).encode()


def write_block(path: Path, identity: BundleIdentity, block_hash: bytes, views: Sequence[memoryview]) -> int:
    """Write the block (``views``: its bytes in each pool, in pool order) to ``path`` atomically; returns the
    file's size. The views must not change while this runs (the caller pins the block)."""
    if sum(v.nbytes for v in views) != identity.layout.block_bytes:
        raise ValueError(f"{sum(v.nbytes for v in views)} bytes given for a {identity.layout.block_bytes}-byte block")
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    header = _header(identity, block_hash, crc)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header)
            for view in views:
                f.write(view)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(MAGIC) + _LEN.size + len(header) + identity.layout.block_bytes


def read_block(path: Path, identity: BundleIdentity, block_hash: bytes, views: Sequence[memoryview]) -> int:
    """Read the block stored at ``path`` into ``views`` (its bytes in each pool); returns the bytes read. Raises
    :class:`BadBlock` for a file that is not this bundle's block ``block_hash`` whole and intact, FileNotFoundError
    when there is none."""
    with open(path, "rb", buffering=0) as f:
        try:
            return _read_open(f, path, identity, block_hash, views)
        except BadBlock as bad:
            st = os.fstat(f.fileno())
            bad.inode = (st.st_dev, st.st_ino)
            raise


def _read_open(f: BinaryIO, path: Path, identity: BundleIdentity, block_hash: bytes,
               views: Sequence[memoryview]) -> int:
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) < len(MAGIC) + _LEN.size:
        raise BadBlock("truncated", f"{path.name}: {len(head)} bytes, shorter than the header")
    if head[:len(MAGIC)] != MAGIC:
        raise BadBlock("foreign", f"{path.name}: not an omforge KV block (magic {head[:8]!r})")
    (size,) = _LEN.unpack(head[len(MAGIC):])
    if size > MAX_HEADER_BYTES:
        raise BadBlock("corrupt", f"{path.name}: a {size}-byte header")
    raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        raise BadBlock("truncated" if len(raw) < size else "corrupt", f"{path.name}: unreadable header") from None
    _check_header(path, header, identity, block_hash)
    crc, got = 0, 0
    for view in views:
        n = f.readinto(view)
        got += n or 0
        if n != view.nbytes:
            raise BadBlock("truncated", f"{path.name}: payload ends after {got} of {identity.layout.block_bytes}"
                                        " bytes")
        crc = zlib.crc32(view, crc)
    if f.read(1):
        raise BadBlock("corrupt", f"{path.name}: bytes after the payload")
    if crc != header["crc32"]:
        raise BadBlock("corrupt", f"{path.name}: checksum {crc:#010x} != {header['crc32']:#010x}")
    return got


def _check_header(path: Path, header: object, identity: BundleIdentity, block_hash: bytes) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise BadBlock("foreign", f"{path.name}: format {header.get('format') if isinstance(header, dict) else '?'}")
    if header.get("identity") != identity.hex:
        raise BadBlock("foreign", f"{path.name}: written by bundle {str(header.get('identity'))[:16]}… "
                                  f"({header.get('model')}), this is {identity.hex[:16]}… ({identity.model})")
    if header.get("layout") != identity.layout.describe():
        raise BadBlock("foreign", f"{path.name}: layout {header.get('layout')} != {identity.layout.describe()}")
    if header.get("block_hash") != block_hash.hex():
        raise BadBlock("foreign", f"{path.name}: holds block {str(header.get('block_hash'))[:16]}…")
    if header.get("payload_bytes") != identity.layout.block_bytes or not isinstance(header.get("crc32"), int):
        raise BadBlock("corrupt", f"{path.name}: header {header.get('payload_bytes')} bytes / crc "
                                  f"{header.get('crc32')!r}")
