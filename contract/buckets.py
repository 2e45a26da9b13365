"""The bucket plan as the runtime reads it: profiles (compiled models and the step shapes they take), the
manifest form, and :func:`pick`, the profile and padded dims of a step. Planning them from a recipe is
compile/bucket_plan.py's job (it imports these). Dependency-free: stdlib and omforge.errors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from omforge.contract import cdiv
from omforge.errors import OmforgeError

STEP_DIMS = ("num_tokens", "num_seqs", "max_query_len", "num_logits", "max_blocks")
"""The step ABI's symbolic dims, in the order :class:`Choice` and the padded tuples use."""
MIN_GEARS, MAX_GEARS = 2, 100
"""ATC's bounds on the gears of one model (``--dynamic_dims``, reference/ascend.md §1.3)."""
TARGETS = ("ort", "ascend")


class BucketError(OmforgeError):
    """Buckets that cannot be compiled or a step no compiled profile takes; ``str(err)`` is one line."""



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
    def from_dict(cls, data: Any) -> BucketPlan:
        """Read :meth:`to_dict`'s form back, checking it (a manifest may be edited or come from another
        version); raises :class:`BucketError` naming the key (a missing one, or one :meth:`to_dict` would drop)."""
        def need(d: Any, key: str, kind: type, where: str) -> Any:
            if not isinstance(d, dict) or key not in d:
                raise BucketError(f"buckets{where}: missing key '{key}'")
            v = d[key]
            if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 1):
                what = "positive integer" if kind is int else kind.__name__
                raise BucketError(f"buckets{where}.{key}: expected a {what} (got {v!r})")
            return v

        def known(d: Any, keys: tuple[str, ...], where: str) -> None:  # what to_dict would drop
            extra = [k for k in d if k not in keys] if isinstance(d, dict) else []
            if extra:
                raise BucketError(f"buckets{where}.{extra[0]}: unknown field (known here: {', '.join(keys)})")

        known(data, ("target", "block_size", "max_batch_size", "max_seq_len", "max_num_tokens", "profiles"), "")
        if need(data, "target", str, "") not in TARGETS:
            raise BucketError(f"buckets.target: {data['target']!r} is not one of {', '.join(TARGETS)}")
        maxima = {k: need(data, k, int, "") for k in ("block_size", "max_batch_size", "max_seq_len", "max_num_tokens")}
        profiles = []
        for i, p in enumerate(need(data, "profiles", list, "")):
            where = f".profiles[{i}]"
            known(p, ("name", "dims", "shape", "gears"), where)
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


def om_gears(plan: BucketPlan) -> tuple[tuple[int, ...], ...]:
    """The gears of the ONE OM that serves every gear profile of ``plan`` (ascend): each profile gear's padded
    step dims in :data:`STEP_DIMS` order, distinct and sorted. One model holds the weights once on the device
    (each loaded OM allocates its own weight memory, reference/ascend.md §5.1); :func:`pick` still chooses by
    profile, and a choice's OM gear is ``(num_tokens, num_seqs, max_query_len, num_logits, max_blocks)``."""
    return tuple(sorted({p.padded(g) for p in plan.profiles for g in p.gears or ()}))


def om_gear(choice: Choice) -> tuple[int, ...]:
    """The OM gear (see :func:`om_gears`) a choice runs on."""
    return (choice.num_tokens, choice.num_seqs, choice.max_query_len, choice.num_logits, choice.max_blocks)


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
                              (max_blocks, cdiv(plan.max_seq_len, bs), "max_seq_len")):
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
