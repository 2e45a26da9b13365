"""Bucket planning: which step shapes each compiled model accepts, and which one a step runs on.

A step (the ABI of :mod:`omforge.passes.paged_kv`) has five symbolic dims, :data:`STEP_DIMS`: ``num_tokens`` (T),
``num_seqs`` (B), ``max_query_len`` (Q), ``num_logits`` (L) and ``max_blocks`` (M, block-table width).

**ascend** compiles two models per bundle, each with two dynamic dims so that gears stay few (ATC takes one value
per ``-1`` dim per gear, 2..100 gears per model and advises few; older CANN allows ≤ 4 dynamic dims per gear;
reference/ascend.md §1.3):

  ``prefill``  one sequence's chunk: B = L = 1, T = Q = the chunk length.  Gear ``(num_tokens, max_blocks)``.
  ``decode``   one new token per sequence: Q = 1, T = L = B.              Gear ``(num_seqs, max_blocks)``.

Gears are the cross product of the recipe's lists (``compile.buckets``): ``prefill_seq_lens × context_lens`` and
``decode_batch_sizes × context_lens``, with ``max_blocks = ceil(context_len / block_size)`` (a context length that
is not a multiple of the block size is rounded up to whole blocks; lengths that round to the same block count are
one gear). A prefill gear ``(c, m)`` that no chunk can use is dropped: a chunk longer than the next smaller chunk
gear ``c'`` needs at least ``ceil((c' + 1) / block_size)`` blocks, so the gear is kept only if ``m`` reaches that.

**ort** runs dynamic shapes, so its one profile ``step`` has no gears: :func:`pick` returns the step's own dims.

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
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

from omforge.errors import OmforgeError
from omforge.recipe import CompileSection

STEP_DIMS = ("num_tokens", "num_seqs", "max_query_len", "num_logits", "max_blocks")
"""The step ABI's symbolic dims, in the order :class:`Choice` and the padded tuples use."""
MIN_GEARS, MAX_GEARS = 2, 100
"""ATC's bounds on the gears of one model (``--dynamic_dims``, reference/ascend.md §1.3)."""
WARN_GEARS = 8
"""Above this many gears per model :func:`plan` warns: compile time and OM size grow with each gear."""
DEFAULT_GEAR_CAP = 8
"""At most this many gears per model when lists are planned from the maxima (so a planned plan never warns)."""
TARGETS = ("ort", "ascend")

_PREFILL_SHAPE = {"num_tokens": "num_tokens", "num_seqs": 1, "max_query_len": "num_tokens", "num_logits": 1,
                  "max_blocks": "max_blocks"}
_DECODE_SHAPE = {"num_tokens": "num_seqs", "num_seqs": "num_seqs", "max_query_len": 1, "num_logits": "num_seqs",
                 "max_blocks": "max_blocks"}


class BucketError(OmforgeError):
    """Buckets that cannot be compiled or a step no compiled profile takes; ``str(err)`` is one line."""


class BucketWarning(UserWarning):
    """Many gears: each one is a separately compiled subgraph."""


@dataclass(frozen=True)
class Profile:
    """One compiled model and the step shapes it accepts.

    ``dims`` are the dynamic dims one gear gives values for, in gear order (a subset of :data:`STEP_DIMS`).
    ``shape`` maps every step dim to a constant or to the name of a dim in ``dims`` whose value it shares (a
    dim in ``dims`` maps to itself). ``gears`` is ``None`` for a fully dynamic model (every step dim free; ort),
    else the sorted, distinct gears (2..100, each ``len(dims)`` positive values). Checked on construction.
    """

    name: str
    dims: tuple[str, ...]
    shape: Mapping[str, int | str]
    gears: tuple[tuple[int, ...], ...] | None

    def __post_init__(self) -> None:
        where = f"bucket profile '{self.name}'"
        if not self.name:
            raise BucketError("bucket profile: empty name")
        if not all(isinstance(d, str) and d in STEP_DIMS for d in self.dims) or len(set(self.dims)) != len(self.dims):
            raise BucketError(f"{where}: dims {list(self.dims)} must be distinct names from {', '.join(STEP_DIMS)}")
        if set(self.shape) != set(STEP_DIMS):
            raise BucketError(f"{where}: shape must map exactly {', '.join(STEP_DIMS)} (got {sorted(self.shape)})")
        for dim, to in self.shape.items():
            if dim in self.dims:
                ok = to == dim
            else:
                ok = to in self.dims if isinstance(to, str) else type(to) is int and to >= 1
            if not ok:
                raise BucketError(f"{where}: shape[{dim}] = {to!r}: expected a positive constant or one of "
                                  f"{list(self.dims)} (a gear dim maps to itself)")
        if self.gears is None:
            if any(self.shape[d] != d for d in STEP_DIMS):
                raise BucketError(f"{where}: a profile without gears is fully dynamic: every dim maps to itself")
            return
        if not MIN_GEARS <= len(self.gears) <= MAX_GEARS:
            raise BucketError(f"{where}: {len(self.gears)} gears; ATC takes {MIN_GEARS}..{MAX_GEARS} per model")
        for i, gear in enumerate(self.gears):
            if len(gear) != len(self.dims):
                raise BucketError(f"{where}: gear {i} {list(gear)}: dims mismatch: {len(gear)} values for "
                                  f"{len(self.dims)} dims ({', '.join(self.dims)})")
            if any(type(v) is not int or v < 1 for v in gear):
                raise BucketError(f"{where}: gear {i} {list(gear)}: every value must be a positive integer")
        if list(self.gears) != sorted(set(self.gears)):
            raise BucketError(f"{where}: gears must be distinct and sorted")

    def padded(self, gear: Sequence[int]) -> tuple[int, ...]:
        """The step dims (in :data:`STEP_DIMS` order) a step runs with on ``gear``."""
        values = dict(zip(self.dims, gear))
        return tuple(to if isinstance(to, int) else values[to] for to in (self.shape[d] for d in STEP_DIMS))

    def largest(self, dim: str) -> int | None:
        """The largest value of step dim ``dim`` over the gears; ``None`` when unbounded (no gears)."""
        if self.gears is None:
            return None
        return max(p[STEP_DIMS.index(dim)] for p in self._by_cost)

    @cached_property
    def _by_cost(self) -> list[tuple[int, ...]]:
        """The gears' padded step dims, cheapest first (see :func:`pick`)."""
        return sorted((self.padded(g) for g in self.gears or ()), key=_cost)

    def input_shape_string(self, inputs: Sequence[tuple[str, Sequence[int | str]]],
                           fixed: Mapping[str, int] | None = None) -> str:
        """ATC's ``--input_shape`` for graph ``inputs`` (``(name, dims)`` in graph order, symbolic dims by
        name): a step dim tied to a gear dim becomes ``-1``, a constant one its value; other symbolic dims
        (``num_slots``) must be given in ``fixed``."""
        return ";".join(f"{name}:{','.join(str(v) for v in self._resolve(name, dims, fixed or {}))}"
                        for name, dims in inputs)

    def dynamic_dims_string(self, inputs: Sequence[tuple[str, Sequence[int | str]]] | None = None) -> str:
        """ATC's ``--dynamic_dims``: gears separated by ``;``, values by ``,``. Without ``inputs`` one value per
        dim of :attr:`dims` in that order (prefill ``num_tokens,max_blocks``; decode ``num_seqs,max_blocks``).
        With the same ``inputs`` as :meth:`input_shape_string`, one value per ``-1`` there, in input order
        then dim order, which is how ATC reads them (a dim shared by several inputs repeats its value)."""
        if self.gears is None:
            raise BucketError(f"bucket profile '{self.name}' has no gears (a dynamic-shape model)")
        order = list(self.dims) if inputs is None else [
            str(self.shape[d]) for name, dims in inputs
            for d, v in zip(dims, self._resolve(name, dims, {}, strict=False)) if v == -1]
        return ";".join(",".join(str(gear[self.dims.index(d)]) for d in order) for gear in self.gears)

    def _resolve(self, name: str, dims: Sequence[int | str], fixed: Mapping[str, int],
                 strict: bool = True) -> list[int]:
        if self.gears is None:
            raise BucketError(f"bucket profile '{self.name}' has no gears (a dynamic-shape model)")
        out = []
        for d in dims:
            if isinstance(d, int):
                out.append(d)
            elif d in self.shape:
                to = self.shape[d]
                out.append(to if isinstance(to, int) else -1)
            elif d in fixed:
                out.append(fixed[d])
            elif strict:
                raise BucketError(f"input {name}: dim '{d}' is not a step dim of profile '{self.name}'; "
                                  f"give its value in fixed")
            else:
                out.append(0)
        return out


@dataclass(frozen=True)
class Choice:
    """The model a step runs on and the step dims to pad its inputs to (each ≥ the step's own)."""

    model: str
    num_tokens: int
    num_seqs: int
    max_query_len: int
    num_logits: int
    max_blocks: int
    gear: tuple[int, ...] | None
    """The gear's values in the profile's dim order (what ``acl.mdl.set_input_dynamic_dims`` is built from);
    ``None`` on a dynamic-shape model."""


@dataclass(frozen=True)
class BucketPlan:
    """The profiles a bundle was compiled with, and the build-time maxima they respect."""

    target: str
    block_size: int
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    profiles: tuple[Profile, ...]

    def profile(self, name: str) -> Profile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise BucketError(f"no bucket profile '{name}' (have {', '.join(p.name for p in self.profiles)})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the manifest; :meth:`from_dict` inverts it."""
        return {"target": self.target, "block_size": self.block_size, "max_batch_size": self.max_batch_size,
                "max_seq_len": self.max_seq_len, "max_num_tokens": self.max_num_tokens,
                "profiles": [{"name": p.name, "dims": list(p.dims), "shape": dict(p.shape),
                              "gears": None if p.gears is None else [list(g) for g in p.gears]}
                             for p in self.profiles]}

    @classmethod
    def from_dict(cls, data: Any) -> "BucketPlan":
        """Read :meth:`to_dict`'s form back, checking it (a manifest may be edited or come from another
        version); raises :class:`BucketError` naming the key."""
        def need(d: Any, key: str, kind: type, where: str) -> Any:
            if not isinstance(d, dict) or key not in d:
                raise BucketError(f"buckets{where}: missing key '{key}'")
            v = d[key]
            if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 1):
                what = "positive integer" if kind is int else kind.__name__
                raise BucketError(f"buckets{where}.{key}: expected a {what} (got {v!r})")
            return v

        if need(data, "target", str, "") not in TARGETS:
            raise BucketError(f"buckets.target: {data['target']!r} is not one of {', '.join(TARGETS)}")
        maxima = {k: need(data, k, int, "") for k in ("block_size", "max_batch_size", "max_seq_len", "max_num_tokens")}
        profiles = []
        for i, p in enumerate(need(data, "profiles", list, "")):
            where = f".profiles[{i}]"
            if isinstance(p, dict) and "gears" not in p:
                raise BucketError(f"buckets{where}: missing key 'gears' (null for a dynamic-shape model)")
            gears = p.get("gears") if isinstance(p, dict) else None
            if gears is not None and (not isinstance(gears, list) or not all(isinstance(g, list) for g in gears)):
                raise BucketError(f"buckets{where}.gears: expected null or a list of lists (got {gears!r})")
            profiles.append(Profile(
                name=need(p, "name", str, where), dims=tuple(need(p, "dims", list, where)),
                shape=dict(need(p, "shape", dict, where)),
                gears=None if gears is None else tuple(tuple(g) for g in gears)))
        return cls(target=data["target"], profiles=tuple(profiles), **maxima)


def plan(compile_section: CompileSection, *, target: str, block_size: int) -> BucketPlan:
    """Plan the bundle's profiles from the recipe's ``compile`` section (see the module docstring).

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

    def blocks(lens: Sequence[int]) -> list[int]:  # context lengths → whole blocks, rounded up
        return sorted({-(-n // bs) for n in lens})

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
            gears = [(x, y) for x, y in gears if -(-(_below(a, x) + 1) // bs) <= y]
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
    return BucketPlan(**base, profiles=tuple(profiles))


def pick(plan: BucketPlan, *, num_tokens: int, num_seqs: int, max_query_len: int, num_logits: int,
         max_blocks: int) -> Choice:
    """The profile and padded dims a step runs with. Pure: same plan and step, same choice.

    On a gear profile the choice is the cheapest gear whose every padded dim is ≥ the step's: cheapest by padded
    ``num_tokens`` (the GEMMs), then ``max_blocks`` (attention), then ``num_seqs × max_query_len``, then profile
    order. With cross-product gears that is the smallest gear that fits: each dim padded to its next gear value.
    A dynamic profile (ort) takes the step's own dims. On ascend a step fits only if it is one sequence's chunk
    (prefill) or one token per sequence (decode, including a single-token chunk): **the scheduler must split
    mixed prefill + decode steps, prefill of several sequences, and chunks longer than the largest chunk gear**;
    :meth:`Profile.largest` gives those bounds. A step that fits nothing, or that exceeds the build-time maxima
    (every target), raises :class:`BucketError`; dims that no step can have raise ``ValueError``.
    """
    step = (num_tokens, num_seqs, max_query_len, num_logits, max_blocks)
    if any(type(v) is not int for v in step) or not (1 <= num_seqs <= num_tokens and 1 <= max_query_len <= num_tokens
                                                      and 0 <= num_logits <= num_tokens and max_blocks >= 1):
        raise ValueError(f"not a step shape: {_describe(step)}")
    bs = plan.block_size
    for value, limit, key in ((num_tokens, plan.max_num_tokens, "max_num_tokens"),
                              (num_seqs, plan.max_batch_size, "max_batch_size"),
                              (max_blocks, -(-plan.max_seq_len // bs), "max_seq_len")):
        if value > limit:
            what = f"{value} blocks of {bs} (> {limit})" if key == "max_seq_len" else f"{value} (> {limit})"
            raise BucketError(f"step ({_describe(step)}) exceeds the build-time maximum compile.{key} "
                              f"{getattr(plan, key)}: {what}")
    best: tuple[tuple[int, ...], Choice] | None = None
    reasons = []
    for order, p in enumerate(plan.profiles):
        if p.gears is None:
            choice, padded = Choice(p.name, *step, gear=None), step
        else:
            padded = next((g for g in p._by_cost if all(x >= s for x, s in zip(g, step))), None)
            if padded is None:
                reasons.append(_why_not(p, step))
                continue
            gear = tuple(padded[STEP_DIMS.index(d)] for d in p.dims)
            choice = Choice(p.name, *padded, gear=gear)
        key = (*_cost(padded), order)
        if best is None or key < best[0]:
            best = (key, choice)
    if best is None:
        raise BucketError(f"no compiled model takes the step ({_describe(step)}): {'; '.join(reasons)}; the "
                          f"scheduler must split mixed prefill/decode steps and keep chunks, batches and contexts "
                          f"within the gears")
    return best[1]


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


def _cost(padded: Sequence[int]) -> tuple[int, int, int]:
    t, b, q, _, m = padded
    return t, m, b * q


def _describe(step: Sequence[int]) -> str:
    return ", ".join(f"{d}={v}" for d, v in zip(STEP_DIMS, step))


def _why_not(p: Profile, step: Sequence[int]) -> str:
    """Why no gear of ``p`` takes ``step``: a constant dim it differs from, or the largest gear it exceeds."""
    for d, s in zip(STEP_DIMS, step):
        to = p.shape[d]
        if isinstance(to, int) and s > to:
            return f"{p.name} takes {d} ≤ {to}, the step has {s}"
    for d in sorted(STEP_DIMS, key=lambda d: d not in p.dims):  # gear dims first: they name the gear
        s, top = step[STEP_DIMS.index(d)], p.largest(d)
        if top is not None and s > top:
            return f"{p.name}: {d}={s} is beyond its largest gear ({top})"
    return f"{p.name}: no single gear covers every dim"


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
