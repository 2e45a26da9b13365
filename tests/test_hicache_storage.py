"""The storage tier's files on their own: the block format's checks (truncated, corrupt, foreign → a miss, never
bytes), atomic writes under concurrent writers, the byte budget with least-recently-used eviction, and replicas
sharing one directory. No bundle: a synthetic identity and numpy pools."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from omforge.runtime.hicache.block_file import BadBlock, read_block, write_block
from omforge.runtime.hicache.identity import BlockLayout, BundleIdentity
from omforge.runtime.hicache.storage import FileTier

LAYOUT = BlockLayout(block_size=4, num_layers=2, kv_heads=2, row_elems=8, kv_dtype="float32", itemsize=4)


def identity(name: str = "m") -> BundleIdentity:
    return BundleIdentity(hashlib.sha256(name.encode()).digest(), name, LAYOUT)


def pools(seed: int, blocks: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((blocks, 4, 2, 8)).astype(np.float32) for _ in range(LAYOUT.num_pools)]


def views(ps: list[np.ndarray], block: int) -> list[memoryview]:
    return [memoryview(p[block]).cast("B") for p in ps]


BOOKS = (".lock", ".usage")  # the directory's shared byte count and its lock (storage.py)


def blocks(tier: FileTier) -> list[Path]:
    """The block files in the tier's directory (not the books, not staging files)."""
    return [p for p in tier.dir.iterdir() if p.name.endswith(".kv") and not p.name.startswith(".")]


def key(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def test_a_block_round_trips_bit_exact(tmp_path: Path) -> None:
    src, dst = pools(0), pools(1)
    tier = FileTier(tmp_path, identity(), 1 << 20)
    assert tier.write(key(1), views(src, 2)) > LAYOUT.block_bytes
    assert tier.write(key(1), views(src, 2)) == 0  # there already: only its recency is bumped
    assert tier.read(key(1), views(dst, 5)) == LAYOUT.block_bytes
    assert all(np.array_equal(a[2], b[5]) for a, b in zip(src, dst))
    temp = [p for p in tier.dir.iterdir() if p.name not in BOOKS and p.name.startswith(".")]
    assert tier.num_blocks == 1 and not temp  # no temp left


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:30]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "corrupt"),
    (lambda p: p.write_bytes(p.read_bytes() + b"x"), "corrupt"),
    (lambda p: p.write_bytes(b"GGUF" + p.read_bytes()[4:]), "foreign"),
])
def test_a_damaged_file_is_a_miss_named_by_its_reason(tmp_path: Path, damage, reason: str) -> None:  # noqa: ANN001
    tier = FileTier(tmp_path, identity(), 1 << 20)
    tier.write(key(1), views(pools(0), 0))
    damage(tier.path(key(1)))
    with pytest.raises(BadBlock) as exc:
        tier.read(key(1), views(pools(1), 0))
    assert exc.value.reason == reason
    assert tier.path(key(1)).exists() == (reason == "foreign")  # truncated / corrupt files are deleted


def test_another_bundles_or_another_blocks_file_is_foreign(tmp_path: Path) -> None:
    """A file copied from another bundle (another identity, or the same name with another layout), or one under
    the wrong block's name, is refused by its header even though its checksum is right."""
    ours = identity("ours")
    path = tmp_path / "x.kv"
    write_block(path, identity("theirs"), key(1), views(pools(0), 0))
    with pytest.raises(BadBlock, match="written by bundle") as exc:
        read_block(path, ours, key(1), views(pools(1), 0))
    assert exc.value.reason == "foreign"
    write_block(path, ours, key(2), views(pools(0), 0))
    with pytest.raises(BadBlock, match="holds block"):
        read_block(path, ours, key(1), views(pools(1), 0))
    other = BundleIdentity(ours.digest, "ours", BlockLayout(4, 2, 2, 8, "int8", 1))
    with pytest.raises(BadBlock, match="layout"):
        read_block(path, other, key(2), [memoryview(bytearray(64)) for _ in range(4)])


def test_concurrent_writers_of_one_block_leave_one_whole_file(tmp_path: Path) -> None:
    """Eight threads, as eight replicas, write the same block at once through their own tiers: the file that
    remains reads back whole and no temporary file is left behind."""
    src = pools(3)
    tiers = [FileTier(tmp_path, identity(), 1 << 20) for _ in range(8)]
    start = threading.Barrier(len(tiers))

    def write(tier: FileTier) -> None:
        start.wait(5)
        for _ in range(20):
            tier.path(key(1)).unlink(missing_ok=True)  # force a real write each time, racing the others
            tier.write(key(1), views(src, 1))

    threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    dst = pools(4)
    tiers[0].read(key(1), views(dst, 0))
    assert all(np.array_equal(a[1], b[0]) for a, b in zip(src, dst))
    assert [p.name for p in blocks(tiers[0])] == [tiers[0].path(key(1)).name]


def test_the_budget_holds_and_the_least_recently_used_block_goes_first(tmp_path: Path) -> None:
    ps = pools(0)
    size = FileTier(tmp_path / "probe", identity(), 1 << 20).write(key(0), views(ps, 0))
    tier = FileTier(tmp_path, identity(), 3 * size + size // 2)  # room for three blocks (sizes are exact)
    for i in range(3):
        tier.write(key(i), views(ps, i))
        os.utime(tier.path(key(i)), ns=(time.time_ns() - (10 - i) * 10**9,) * 2)  # distinct ages: 0 oldest
    tier.read(key(0), views(pools(1), 0))  # a hit makes block 0 the most recent
    tier.write(key(3), views(ps, 3))
    left = sorted(p.name for p in blocks(tier))
    assert left == sorted(tier.path(key(i)).name for i in (0, 2, 3))  # block 1 was the least recently used
    assert sum(p.stat().st_size for p in blocks(tier)) <= tier.capacity


def test_replicas_sharing_a_directory_see_each_others_blocks_and_budget(tmp_path: Path) -> None:
    a, b = FileTier(tmp_path, identity(), 1 << 20), FileTier(tmp_path, identity(), 1 << 20)
    other = FileTier(tmp_path, identity("other"), 1 << 20)
    a.write(key(1), views(pools(0), 0))
    assert b.contains(key(1)) and not other.contains(key(1))  # each bundle in its own subdirectory
    dst = pools(1)
    b.read(key(1), views(dst, 0))
    assert np.array_equal(dst[0][0], pools(0)[0][0])
    b.rescan()
    assert b.num_blocks == 1  # a's file counts against b's budget


def test_a_budget_below_one_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no"):
        FileTier(tmp_path, identity(), LAYOUT.block_bytes - 1)


def test_replicas_sharing_a_directory_stay_within_the_budget(tmp_path: Path) -> None:
    """Issue 45 defect 8: two replicas (two tiers on one directory), one budget of 40 blocks, writing distinct
    blocks in turn: the bytes on disk never exceed the budget (at f2437b2 each replica overshot by up to its
    rescan interval: 1.96x the budget)."""
    ident = identity()
    block_file = FileTier(tmp_path, ident, 1 << 20)
    block_file.write(key(255), views(pools(0), 0))
    size = block_file.path(key(255)).stat().st_size
    block_file.path(key(255)).unlink()
    budget = 40 * size
    a, b = FileTier(tmp_path, ident, budget), FileTier(tmp_path, ident, budget)
    src = pools(0)
    worst = 0
    for i in range(200):
        (a if i % 2 else b).write(hashlib.sha256(b"block %d" % i).digest(), views(src, i % 6))
        worst = max(worst, sum(p.stat().st_size for p in blocks(a)))
    assert worst <= budget, (worst / budget, budget)


def test_a_corrupt_file_replaced_by_a_good_one_meanwhile_is_not_deleted(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45 defect 9: replica A reads a corrupt block file; before A acts on it, replica B renames a good file
    over that name. A must not delete B's good file (at f2437b2 it unlinked whatever the name held)."""
    import omforge.runtime.hicache.storage as storage

    a, b = FileTier(tmp_path, identity(), 1 << 20), FileTier(tmp_path, identity(), 1 << 20)
    src = pools(0)
    a.write(key(1), views(src, 1))
    path = a.path(key(1))
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))  # corrupt
    real = storage.read_block

    def racing(*args, **kwargs):  # noqa: ANN202 - read_block's own signature
        try:
            return real(*args, **kwargs)
        finally:
            path.unlink()  # replica B rewrites the block: a good file renamed over the name
            assert b.write(key(1), views(src, 1)) > 0

    monkeypatch.setattr(storage, "read_block", racing)
    with pytest.raises(BadBlock, match="corrupt"):
        a.read(key(1), views(pools(1), 0))
    monkeypatch.undo()
    dst = pools(2)
    assert path.exists() and a.read(key(1), views(dst, 3)) == LAYOUT.block_bytes  # B's good file, intact
    assert all(np.array_equal(s[1], d[3]) for s, d in zip(src, dst))
