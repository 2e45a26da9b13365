"""Bucket planning: which step shapes each compiled model accepts, and which one a step runs on.

A step (the ABI of :mod:`omforge.passes.paged_kv`) has five symbolic dims, :data:`STEP_DIMS`: ``num_tokens`` (T),
``num_seqs`` (B), ``max_query_len`` (Q), ``num_logits`` (L) and ``max_blocks`` (M, block-table width).

**ascend** plans two gear profiles, each with two dynamic dims so that gears stay few (2..100 gears per model,
ATC advises few; reference/ascend.md §1.3), and compiles them into ONE OM whose gears are both profiles' gears over
the five step dims (:func:`~omforge.contract.buckets.om_gears`; the weights are then on the device once, §5.1):

  ``prefill``  one sequence's chunk: B = L = 1, T = Q = the chunk length.  Gear ``(num_tokens, max_blocks)``.
  ``decode``   one new token per sequence: Q = 1, T = L = B.              Gear ``(num_seqs, max_blocks)``.

Gears are the cross product of the recipe's lists (``compile.buckets``): ``prefill_seq_lens × context_lens`` and
``decode_batch_sizes × context_lens``, with ``max_blocks = ceil(context_len / block_size)`` (a context length that
is not a multiple of the block size is rounded up to whole blocks; lengths that round to the same block count are
one gear). A prefill gear ``(c, m)`` that no chunk can use is dropped: a chunk longer than the next smaller chunk
gear ``c'`` needs at least ``ceil((c' + 1) / block_size)`` blocks, so the gear is kept only if ``m`` reaches that.

**ort** runs dynamic shapes, so its one profile ``step`` has no gears: :func:`pick` returns the step's own dims.

A **pooling** bundle (task embed | score; contract/pooling.py) has no KV pool and no decode: on ascend its one
profile ``pool`` has prefill-only gears over whole padded sequences (:func:`pooling_profile`).

Empty recipe lists are planned from the build-time maxima (``compile.max_*``):

  prefill_seq_lens    powers of two from 128 up to min(max_num_tokens, max_seq_len), and that bound itself
  decode_batch_sizes  powers of two from 1 up to min(max_batch_size, max_num_tokens), and that bound itself
  context_lens        powers of two from 512 up to max_seq_len, and max_seq_len itself

then thinned, per model, to at most :data:`DEFAULT_GEAR_CAP` gears: keeping ``k`` of ``n`` values means the values
at the evenly spaced positions ``round(i (n-1) / (k-1))`` (the smallest and the largest always kept; ``k = 1``
keeps the largest). Only planned lists are thinned (explicit ones are kept whole), and the pair of ``k`` is the one
with the smallest worst-case padding: the largest ratio ``gear / value`` by which a step value from 1 up to the
largest gear is padded, multiplied over the two dims (decode attention reads ``num_seqs × max_blocks`` padded
blocks); ties go to more gears, then to more context gears. E.g. the defaults (2048 tokens, 64 sequences, block
128) give prefill 128, 256, 1024, 2048 × context 512, 2048 (7 gears, one dropped) and decode 1, 4, 16, 64 ×
context 512, 2048 (8 gears).

Invariants: every gear profile has 2..100 distinct gears, sorted, each with one value per dim of
:attr:`Profile.dims` (checked whenever a :class:`Profile` is made, so also on :meth:`BucketPlan.from_dict`); a plan
from :func:`plan` keeps every gear value within the build-time maxima, and is a function of its arguments.
Recipe defects raise :class:`BucketError` with one line naming the recipe key; above :data:`WARN_GEARS` gears per
model it warns (:class:`BucketWarning`), since each gear is a separately compiled subgraph.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

# the plan's types live in the contract (the runtime's side); the planner builds them
from omforge.contract import cdiv
from omforge.contract.buckets import (
    MAX_GEARS,
    MIN_GEARS,
    STEP_DIMS,
    TARGETS,
    BucketError,
    BucketPlan,
    Profile,
    om_gears,
)
from omforge.recipe import CompileSection

WARN_GEARS = 8
"""Above this many gears per model :func:`plan` warns: compile time and OM size grow with each gear."""
DEFAULT_GEAR_CAP = 8
"""At most this many gears per model when lists are planned from the maxima (so a planned plan never warns)."""

_PREFILL_SHAPE = {"num_tokens": "num_tokens", "num_seqs": 1, "max_query_len": "num_tokens", "num_logits": 1,
                  "max_blocks": "max_blocks"}
_DECODE_SHAPE = {"num_tokens": "num_seqs", "num_seqs": "num_seqs", "max_query_len": 1, "num_logits": "num_seqs",
                 "max_blocks": "max_blocks"}


class BucketWarning(UserWarning):
    """Many gears: each one is a separately compiled subgraph."""


def plan(compile_section: CompileSection, *, target: str, block_size: int, pooling: bool = False) -> BucketPlan:
    """Plan the bundle's profiles from the recipe's ``compile`` section (see the module docstring); ``pooling``: a
    pooling bundle's (:func:`pooling_profile` on ascend).

    Explicit bucket values are checked against the maxima on every target, though only ascend uses them.
    """
    c = compile_section
    if target not in TARGETS:
        raise BucketError(f"compile.target: {target!r} is not one of {', '.join(TARGETS)}")
    if block_size < 1:
        raise BucketError(f"compile.kv_block_size: {block_size} must be a positive integer")
    _check_limits(c)
    base = dict(target=target, block_size=block_size, max_batch_size=c.max_batch_size,
                max_seq_len=c.max_seq_len, max_num_tokens=c.max_num_tokens)
    if target == "ort":
        return BucketPlan(**base, profiles=(Profile("step", STEP_DIMS, {d: d for d in STEP_DIMS}, None),))

    b = c.buckets
    bs = block_size
    if pooling:
        return BucketPlan(**base, profiles=(pooling_profile(c),))

    def blocks(lens: Sequence[int]) -> list[int]:  # context lengths → whole blocks, rounded up
        return sorted({cdiv(n, bs) for n in lens})

    ctx = _Axis("context_lens", blocks(b.context_lens or _powers(512, c.max_seq_len)), not b.context_lens,
                f"planned from compile.max_seq_len {c.max_seq_len}", scale=bs)
    chunk_max, batch_max = min(c.max_num_tokens, c.max_seq_len), min(c.max_batch_size, c.max_num_tokens)
    models = (
        ("prefill", _PREFILL_SHAPE, ("num_tokens", "max_blocks"),
         _Axis("prefill_seq_lens", list(b.prefill_seq_lens or _powers(128, chunk_max)), not b.prefill_seq_lens,
               f"planned from compile.max_num_tokens {c.max_num_tokens} and compile.max_seq_len {c.max_seq_len}")),
        ("decode", _DECODE_SHAPE, ("num_seqs", "max_blocks"),
         _Axis("decode_batch_sizes", list(b.decode_batch_sizes or _powers(1, batch_max)), not b.decode_batch_sizes,
               f"planned from compile.max_batch_size {c.max_batch_size} and compile.max_num_tokens "
               f"{c.max_num_tokens}")),
    )
    profiles = []
    for name, shape, dims, first in models:
        a, m = _thin_pair(first, ctx)
        gears = list(itertools.product(a, m))
        if name == "prefill":  # drop gears no chunk can reach (module docstring)
            gears = [(x, y) for x, y in gears if cdiv(_below(a, x) + 1, bs) <= y]
        n, full = len(gears), len(a) * len(m)
        lists = (f"{first.describe(a)} × {ctx.describe(m)}"
                 + (f"; {full - n} gears no chunk can use dropped" if n < full else ""))
        if n < MIN_GEARS:
            raise BucketError(f"compile.buckets: the {name} model has {n} gear{'s' * (n != 1)} ({lists}); ATC needs "
                              f"at least {MIN_GEARS} gears per model; give at least two values in "
                              f"compile.buckets.{first.key} or compile.buckets.context_lens")
        if n > MAX_GEARS:
            raise BucketError(f"compile.buckets: the {name} model has {n} gears ({lists}); ATC allows at most "
                              f"{MAX_GEARS} per model; give fewer values in compile.buckets.{first.key} or "
                              f"compile.buckets.context_lens")
        if n > WARN_GEARS:
            warnings.warn(f"compile.buckets: the {name} model has {n} gears ({lists}); each gear is a separately "
                          f"compiled subgraph, so ATC's compile time and the OM's size grow with the count (its "
                          f"docs advise few); {WARN_GEARS} or fewer keep it quick", BucketWarning, stacklevel=2)
        profiles.append(Profile(name, dims, shape, tuple(sorted(gears))))
    result = BucketPlan(**base, profiles=tuple(profiles))
    total = len(om_gears(result))  # one OM serves both profiles (weights once on the device)
    if total > MAX_GEARS:
        raise BucketError(f"compile.buckets: the OM's gears (prefill and decode together) number {total}; ATC allows "
                          f"at most {MAX_GEARS} per model; give fewer values in compile.buckets")
    return result


def pooling_profile(c: CompileSection) -> Profile:
    """A pooling bundle's one profile on ascend (contract/pooling.py: no KV pool, whole sequences right-padded to a
    common length): prefill-only gears ``(num_tokens, num_seqs, max_query_len)`` with ``num_tokens = num_seqs ×
    max_query_len`` within ``max(max_num_tokens, max_seq_len)`` tokens. Planned: 4 lengths of the powers of two
    from 128 up to ``max_seq_len`` (thinned as the generate profiles are), each with 1 and the most sequences of
    that length a step holds (up to ``max_batch_size``); explicit ``prefill_seq_lens`` × ``decode_batch_sizes``
    (sequences per step) are crossed and kept where the step fits."""
    b = c.buckets
    most = max(c.max_num_tokens, c.max_seq_len)
    lens = list(b.prefill_seq_lens) or _thin(_powers(128, c.max_seq_len), 4)
    if b.decode_batch_sizes:
        gears = {(x * y, x, y) for x in b.decode_batch_sizes for y in lens if x * y <= most}
    else:
        gears = {(x * y, x, y) for y in lens for x in (1, min(c.max_batch_size, most // y))}
    if not MIN_GEARS <= len(gears) <= MAX_GEARS:
        raise BucketError(f"compile.buckets: the pooling model has {len(gears)} gears (sequence lengths {lens}, "
                          f"steps of at most {most} tokens); ATC takes {MIN_GEARS} to {MAX_GEARS}: give other "
                          "compile.buckets.decode_batch_sizes / prefill_seq_lens")
    return Profile("pool", ("num_tokens", "num_seqs", "max_query_len"),
                   {"num_tokens": "num_tokens", "num_seqs": "num_seqs", "max_query_len": "max_query_len",
                    "num_logits": "num_seqs", "max_blocks": 1}, tuple(sorted(gears)))


@dataclass(frozen=True)
class _Axis:
    """One gear list of a model: the recipe's values, or values ``planned`` from the maxima (``source`` says
    how). ``scale`` turns a value into tokens for messages (context gears are in blocks)."""

    key: str
    values: list[int]
    planned: bool
    source: str
    scale: int = 1

    def describe(self, kept: list[int]) -> str:
        notes = [f"tokens, whole blocks of {self.scale}"] if self.scale > 1 else []
        notes += [self.source] if self.planned else []
        return f"{self.key} {[v * self.scale for v in kept]}" + (f" ({'; '.join(notes)})" if notes else "")


def _thin_pair(a: _Axis, b: _Axis) -> tuple[list[int], list[int]]:
    """Thin the planned lists of one model to at most DEFAULT_GEAR_CAP gears (module docstring)."""
    va, vb = a.values, b.values
    ks_a = range(1, len(va) + 1) if a.planned else [len(va)]
    ks_b = range(1, len(vb) + 1) if b.planned else [len(vb)]
    least = min(MIN_GEARS, len(va) * len(vb))
    options = [(ka, kb) for ka in ks_a for kb in ks_b if ka * kb >= least]
    ka, kb = min(options, key=lambda k: (max(k[0] * k[1] - DEFAULT_GEAR_CAP, 0),
                                         _padding(_thin(va, k[0])) * _padding(_thin(vb, k[1])),
                                         -k[0] * k[1], -k[1]))
    return _thin(va, ka), _thin(vb, kb)


def _thin(values: list[int], k: int) -> list[int]:
    """``k`` of ``values`` at evenly spaced positions (smallest and largest kept; ``k = 1`` keeps the largest)."""
    n = len(values)
    if k >= n:
        return list(values)
    if k == 1:
        return [values[-1]]
    return [values[(2 * i * (n - 1) + k - 1) // (2 * (k - 1))] for i in range(k)]


def _padding(kept: list[int]) -> float:
    """The worst ratio by which a step value in ``1 .. kept[-1]`` is padded up to its gear in ``kept``."""
    return max(g / (lo + 1) for g, lo in zip(kept, [0, *kept[:-1]]))


def _powers(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` up to ``hi``, and ``hi`` itself (just ``[hi]`` when ``hi < lo``)."""
    out, p = [], lo
    while p < hi:
        out.append(p)
        p *= 2
    return [*out, hi]


def _below(values: list[int], x: int) -> int:
    """The largest value of ``values`` under ``x``; 0 if none."""
    return max((v for v in values if v < x), default=0)


def _check_limits(c: CompileSection) -> None:
    """Explicit gear values must lie within the build-time maxima (one line naming the key)."""
    b = c.buckets
    checks = (
        ("prefill_seq_lens", b.prefill_seq_lens, "max_num_tokens", c.max_num_tokens,
         "the most tokens a step is built for"),
        ("prefill_seq_lens", b.prefill_seq_lens, "max_seq_len", c.max_seq_len, "a chunk is part of one sequence"),
        ("decode_batch_sizes", b.decode_batch_sizes, "max_batch_size", c.max_batch_size,
         "the most sequences a step is built for"),
        ("decode_batch_sizes", b.decode_batch_sizes, "max_num_tokens", c.max_num_tokens,
         "a decode step of N sequences has N tokens"),
        ("context_lens", b.context_lens, "max_seq_len", c.max_seq_len, "the longest sequence the graphs are built for"),
    )
    for key, values, limit_key, limit, why in checks:
        over = [v for v in values if v > limit]
        if over:
            raise BucketError(f"compile.buckets.{key}: {over[0]} exceeds compile.{limit_key} ({limit}), {why}")
