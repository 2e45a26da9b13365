"""The ACL executor's logic, as plain Python: which gear each part of a step runs on, the padded inputs of each
execution, the dims list that selects the gear, the device-copy plan for the new K/V rows, and the check of a loaded
model's description against the bundle. No ``acl`` here (that is :mod:`omforge.runtime.ascend.acl_api`), so all of it is
unit-tested on any machine.

An ascend bundle has ONE OM whose gears cover two bucket profiles (:mod:`omforge.compile.bucket_plan`): ``prefill``
(one sequence's chunk, ``num_tokens × max_blocks``) and ``decode`` (one token per sequence, ``num_seqs ×
max_blocks``), each gear a point of the five step dims (:func:`~omforge.contract.buckets.om_gears`). The
scheduler's steps mix prefill chunks of several sequences and decodes, so :func:`plan_runs` splits a step into
executions, in order:

- every single-token item (decodes, and a chunk of one token) goes to ``decode`` runs of at most the largest
  ``num_seqs`` gear, padded with dummy sequences (token 0 at position 0 over block 0; their rows are never copied);
- every longer chunk goes to ``prefill`` runs, one sequence each, split into pieces whose *padded* end stays inside
  the context: the step graph scatters every token's new K/V row into the gathered context at its position, so the
  padding tokens (positions after the chunk) need room there too — ``start + gear ≤ min(max_blocks gear ×
  block_size, max_seq_len)``. Hence the longest prompt an ascend bundle admits: :func:`max_prompt_len`.

In-place bundles (manifest ``ascend.paged_attention == "inplace"``): the graph writes each token's row into the pools
at its ``slot_mapping`` slot and a paged kernel reads them; a gear's padding rows are written to DISTINCT slots of the
pool's last blocks (:class:`Scratch`: ScatterPaKvCache requires unique, in-range slots, reference §5.3), padding
sequences read a scratch block with lengths 1/1, and padding tokens never enter a real sequence's blocks — so a
prefill piece needs blocks only up to its real end, and the longest prompt follows the gears.

Invariants: each real token is computed exactly once, pieces of one sequence run in order (each piece's rows are in
the pool before the next runs), every run's dims equal one compiled gear, and the logits come back in the order of
the step's items that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omforge.contract import cdiv
from omforge.contract.ascend import DYNAMIC_INPUT, SEQ_LENS_KV, SEQ_LENS_Q, SLOT_MAPPING
from omforge.contract.buckets import STEP_DIMS, BucketError, BucketPlan, Choice, pick
from omforge.errors import OmforgeError
from omforge.runtime.step import SeqWork

ACL_DTYPES: dict[int, np.dtype] = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 2: np.dtype(np.int8),
                                   3: np.dtype(np.int32), 4: np.dtype(np.uint8), 9: np.dtype(np.int64),
                                   12: np.dtype(np.bool_)}
"""aclDataType codes (reference §3.1) we can hold in numpy (27 bfloat16 has no numpy dtype)."""

STEP_GRAPH_INPUTS = ("input_ids", "position_ids", "block_tables", "query_index", "token_index", "logits_indices")
"""The gather step graph's step inputs (the ABI less ``slot_mapping``: the runtime places the new rows itself)."""
INPLACE_STEP_INPUTS = (*STEP_GRAPH_INPUTS, SLOT_MAPPING, SEQ_LENS_Q, SEQ_LENS_KV)
"""What :func:`pack_run` makes for an in-place step graph (its pools are bound, never packed)."""
READONLY_STEP_INPUTS = (*STEP_GRAPH_INPUTS, SEQ_LENS_Q, SEQ_LENS_KV)
"""What :func:`pack_run` makes for a readonly step graph (no ``slot_mapping``: the executor places kv_new's rows)."""

MAX_DIM_CNT = 128
"""ACL_MAX_DIM_CNT: a gear's dims list holds at most 128 values (hicann/ge ``model_om2.cpp``; reference §3.4)."""

DESC_SIZE_SLACK = 64
"""A described size may exceed the tensor's bytes by this much: the graph engine pads tensor descriptors by 32 bytes
(graph_metadef ``tensor_utils.cc``) while a Data input reports its raw size (``davinci_model.cc``; reference §5.2)."""

COPY_ALIGN = 64
"""``acl.rt.memcpy_async`` needs 64-byte-aligned source and destination addresses (aclpythondevg_01_0125; reference
§3.2): every pool slot, and every row of ``kv_new``, starts at a multiple of it."""


class AclModelMismatch(OmforgeError):
    """A loaded OM's description disagrees with the bundle's manifest (wrong file, stale build)."""


# --- the model description ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorDesc:
    name: str
    size: int  # bytes of the largest gear (acl.mdl.get_input_size_by_index)
    dims: tuple[int, ...]  # -1 where a gear sets the value
    dtype: int  # aclDataType


@dataclass(frozen=True)
class ModelDesc:
    """What ``acl.mdl.get_desc`` tells about one loaded model (built by :func:`acl_api.AclRuntime.describe`)."""

    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]
    gears: tuple[tuple[int, ...], ...]  # per gear, the dims list set_input_dynamic_dims takes
    dynamic_index: int | None  # index of DYNAMIC_INPUT

    def input(self, name: str) -> TensorDesc:
        return next(t for t in self.inputs if t.name == name)


def gear_dims(gear: Sequence[int], input_shape: Sequence[tuple[str, Sequence[int | str]]]) -> list[int]:
    """The ``dims`` of ``acl.mdl.set_input_dynamic_dims`` for an OM gear (its step dims in :data:`STEP_DIMS`
    order, :func:`~omforge.contract.buckets.om_gear`): every dim of each input ATC's ``--input_shape`` listed, in
    that order, static dims included (hicann/ge ``multi_batch_clone_pass.cc`` builds the list so; reference §3.4)."""
    padded = dict(zip(STEP_DIMS, gear))
    return [d if isinstance(d, int) else padded[d] for _, dims in input_shape for d in dims]


def output_name(acl_name: str) -> str:
    """The ONNX output name in ACL's ``op-name:edge-index:tensor-name`` form for ONNX-converted models (the part
    after the last ``:``; aclmdlGetOutputNameByIndex, reference §3.3); a bare name stays as it is."""
    return acl_name.rsplit(":", 1)[-1]


def check_desc(desc: ModelDesc, inputs: Sequence[str], outputs: Sequence[str],
               input_shape: Sequence[tuple[str, Sequence[int | str]]], gears: Sequence[Sequence[int]],
               pools: Sequence[tuple[str, int]]) -> None:
    """Raise :class:`AclModelMismatch` naming the first difference between the OM and what the executor binds: the
    input names in order (the dataset is built in the OM's order; an OM whose build route moved its RefData inputs,
    e.g. after the Data ones as torchair numbers them, must have the manifest say that order), the dynamic-dims input
    last; outputs by index (the ONNX parser keeps the graph's output order, Ascend/parser ``onnx_parser.cc``), each
    ACL name ending in the manifest's; the compiled gears against the manifest's; each pool input's size."""
    names = [t.name for t in desc.inputs if t.name != DYNAMIC_INPUT]
    if names != list(inputs):
        first = next((i for i, (a, b) in enumerate(zip(names, inputs)) if a != b), min(len(names), len(inputs)))
        raise AclModelMismatch(f"OM: input {first} is '{names[first] if first < len(names) else None}', the "
                               f"executor binds '{inputs[first] if first < len(inputs) else None}' there (OM inputs "
                               f"{len(names)}, manifest {len(inputs)})")
    if desc.dynamic_index is None:
        raise AclModelMismatch(f"OM: no {DYNAMIC_INPUT} input: it was not compiled with gears (--dynamic_dims)")
    if len(desc.outputs) != len(outputs):
        raise AclModelMismatch(f"OM: {len(desc.outputs)} outputs, the manifest has {len(outputs)} ({list(outputs)})")
    for i, (t, want) in enumerate(zip(desc.outputs, outputs)):
        if output_name(t.name) != want:
            raise AclModelMismatch(f"OM: output {i} is '{t.name}', the manifest's is '{want}'")
    want_gears = [tuple(gear_dims(g, input_shape)) for g in gears]
    if len(desc.gears) != len(want_gears):
        raise AclModelMismatch(f"OM: {len(desc.gears)} gears compiled, the manifest has {len(want_gears)}")
    missing = [g for g in want_gears if g not in set(desc.gears)]
    if missing:
        raise AclModelMismatch(f"OM: the manifest's gear dims {list(missing[0])} are not among the compiled gears")
    for name, nbytes in pools:
        if not nbytes <= desc.input(name).size <= nbytes + DESC_SIZE_SLACK:
            raise AclModelMismatch(f"OM: input '{name}' holds {desc.input(name).size} bytes, the manifest's pool "
                                   f"needs {nbytes} (up to {DESC_SIZE_SLACK} more is descriptor padding)")


def check_slot_alignment(slot_bytes: int) -> None:
    """Refuse a pool whose slots do not start at multiples of :data:`COPY_ALIGN` bytes (the runtime copies new rows
    slot by slot with ``memcpy_async``, whose addresses must be 64-byte aligned; the pool's base is, as a malloc)."""
    if slot_bytes % COPY_ALIGN:
        raise AclModelMismatch(f"KV pool slot of {slot_bytes} bytes is not a multiple of {COPY_ALIGN}: "
                               f"acl.rt.memcpy_async needs {COPY_ALIGN}-byte-aligned addresses (reference §3.2)")


@dataclass(frozen=True)
class DeviceNeed:
    """What loading a bundle takes of the device, in bytes: on the load path of manifest ``ACL_LOAD_PATH``
    (``optimized``: I/O in the model's work memory: none; ours: once), or on the fallback ``load_from_file``
    (``work`` then holds the model's inputs and outputs again: the pool counts twice)."""

    weights: int
    work: int  # the model's own work memory: without its inputs and outputs when optimized, with them otherwise
    pool: int
    io: int  # the step's input and output buffers at the largest gear
    measured: bool  # weights and work from aclmdlQuerySize, else the manifest's estimate
    optimized: bool = True  # loaded with ACL_MDL_WORKSPACE_MEM_OPTIMIZE = 1

    @property
    def total(self) -> int:
        return self.weights + self.work + self.pool + self.io


def device_need(weights: int, work_estimate: int, io: int, pool: int, queried: tuple[int, int] | None,
                optimized: bool = True) -> DeviceNeed:
    """The device memory a load needs: the compile-time plan's figures, or ATC's own (``queried`` = aclmdlQuerySize's
    ``(work, weight)``). Query_size's work includes every input and output of the model, the pool too (hicann/ge
    ``graph_builder.cc``; reference §5.2); with ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` (``optimized``) GE does not
    allocate them, the runtime does: they are taken out of the work once and counted once as ours. Loaded without
    the option (the fallback when ACL refuses it), the same OM needs ``weights + queried work + pool + io``: the
    pool twice."""
    if queried is None:
        return DeviceNeed(weights, work_estimate + (0 if optimized else pool + io), pool, io, False, optimized)
    work, weights = queried
    return DeviceNeed(weights, max(work - pool - io, 0) if optimized else work, pool, io, True, optimized)


# --- splitting a step into executions -----------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Tokens ``start .. start + count - 1`` of item ``item`` (index into the step's work list)."""

    item: int
    start: int
    count: int
    logits: bool  # this piece ends the item and the item needs logits


@dataclass(frozen=True)
class Run:
    """One execution of one compiled model on one gear."""

    choice: Choice
    pieces: tuple[Piece, ...]


def max_prompt_len(plan: BucketPlan, inplace: bool = False) -> int:
    """The longest prompt whose prefill always fits. Gather: a last piece of one token at position ``p`` pads to the
    smallest chunk gear ``g0``, so ``p + g0 ≤ max_seq_len``. In place: padding rows go to scratch slots, so a piece
    needs blocks up to its real end only: what the largest prefill gear's block table holds, within the context."""
    prefill = plan.profile("prefill")
    if inplace:
        return min(plan.max_seq_len, (prefill.largest("max_blocks") or 0) * plan.block_size)
    g0 = min(g[0] for g in prefill.gears or ())
    return plan.max_seq_len - g0 + 1


def plan_runs(work: Sequence[SeqWork], plan: BucketPlan, inplace: bool = False) -> list[Run]:
    """Split a step into gear executions (see the module docstring; ``inplace``: an in-place bundle, whose padding
    rows need no room in the context). Raises :class:`BucketError` for an item no gear can take (the engine's
    admission keeps prompts within :func:`max_prompt_len`)."""
    bs = plan.block_size
    decode = plan.profile("decode")
    max_batch = decode.largest("num_seqs")
    singles = [i for i, w in enumerate(work) if len(w.token_ids) == 1]
    runs: list[Run] = []
    for at in range(0, len(singles), max_batch):
        group = singles[at:at + max_batch]
        blocks = max(cdiv(work[i].start + 1, bs) for i in group)
        choice = pick(_only(plan, "decode"), num_tokens=len(group), num_seqs=len(group), max_query_len=1,
                      num_logits=len(group), max_blocks=blocks)
        runs.append(Run(choice, tuple(Piece(i, work[i].start, 1, work[i].needs_logits) for i in group)))
    prefill = _only(plan, "prefill")
    chunk_gears = sorted({g[0] for g in plan.profile("prefill").gears or ()})
    for i, w in enumerate(work):
        start, left = w.start, len(w.token_ids)
        if left == 1:
            continue
        while left > 0:
            count, choice = _prefill_piece(prefill, chunk_gears, start, left, bs, inplace)
            left -= count
            runs.append(Run(choice, (Piece(i, start, count, w.needs_logits and left == 0),)))
            start += count
    return runs


def _prefill_piece(plan: BucketPlan, chunk_gears: list[int], start: int, left: int, bs: int,
                   inplace: bool = False) -> tuple[int, Choice]:
    """The longest piece (≤ ``left`` tokens from ``start``) that fits a gear with its padding inside the context
    (in place: its real tokens; the padding goes to scratch slots)."""
    for gear in sorted(chunk_gears, reverse=True):  # the largest piece first
        count = min(left, gear)
        g = next(c for c in chunk_gears if c >= count)  # padded to the smallest chunk gear that holds it
        end = start + (count if inplace else g)
        if end > plan.max_seq_len:
            continue
        try:
            return count, pick(plan, num_tokens=g, num_seqs=1, max_query_len=g, num_logits=1, max_blocks=cdiv(end, bs))
        except BucketError:
            continue
    raise BucketError(f"no prefill gear takes a chunk at position {start} ({left} tokens left): with the smallest "
                      f"chunk gear {chunk_gears[0]} the padded chunk would end past the context "
                      f"({plan.max_seq_len}); prompts up to {plan.max_seq_len - chunk_gears[0] + 1} tokens fit")


def _only(plan: BucketPlan, name: str) -> BucketPlan:
    """The plan restricted to one profile (so :func:`pick` cannot choose the other model)."""
    return BucketPlan(plan.target, plan.block_size, plan.max_batch_size, plan.max_seq_len, plan.max_num_tokens,
                      (plan.profile(name),))


# --- the inputs of one run, and where its new rows go ------------------------------------------------------


@dataclass(frozen=True)
class Scratch:
    """The pool's last ``blocks`` blocks, from block ``first``: never handed to the block pool; a gear's padding rows
    are written to distinct slots there (ScatterPaKvCache: slots unique and in ``[0, num_blocks·block_size−1]``,
    ops-transformer ``scatter_pa_kv_cache_def.cpp:115-176``, reference §5.3) and padding sequences read block
    ``first``."""

    first: int
    blocks: int
    block_size: int

    def slots(self, n: int) -> np.ndarray:
        """``n`` distinct scratch slots; ValueError (one line) when the scratch blocks hold fewer."""
        if n > self.blocks * self.block_size:
            raise ValueError(f"{n} padding rows, the {self.blocks} scratch block(s) hold "
                             f"{self.blocks * self.block_size}")
        return self.first * self.block_size + np.arange(n, dtype=np.int64)


@dataclass
class PackedRun:
    inputs: dict[str, np.ndarray]  # the step graph's inputs at the gear's shapes (int64; cast to the desc's dtype)
    slots: np.ndarray  # [rows] pool slot of each real token's new row, in model-row order (rows 0..n-1)
    logit_rows: list[tuple[int, int]] = field(default_factory=list)  # (row in the model's logits, item)


def pack_run(run: Run, work: Sequence[SeqWork], block_size: int, scratch: Scratch | None = None,
             readonly: bool = False) -> PackedRun:
    """The padded inputs of ``run``: real tokens first (model rows ``0..n-1``), padding after them.

    prefill: one sequence; padding tokens continue the positions after the chunk (masked from the real queries by
    position, their rows never copied); the block table is padded with its first block.
    decode: one token per sequence; padding sequences hold token 0 at position 0 over block 0.

    In place (``scratch`` given) it also makes ``slot_mapping`` (the real rows' slots, then distinct scratch slots
    for the padding rows), ``actual_seq_lengths`` (query tokens per sequence) and ``actual_seq_lengths_kv`` (context
    after the write); padding tokens of a prefill piece repeat its last real position (they stay inside the
    context: no real row reads them), padding sequences read scratch block ``first`` with lengths 1 and 1.

    ``readonly``: ``actual_seq_lengths`` as in place, ``actual_seq_lengths_kv`` ``max(context BEFORE the run, 1)``
    (FIA never gets an empty context; the graph drops that part where the first query is at position 0), prefill
    padding rows at the last real position; no ``slot_mapping`` (the executor copies ``kv_new``'s real rows).
    """
    c, bs = run.choice, block_size
    T, B, Q, M = c.num_tokens, c.num_seqs, c.max_query_len, c.max_blocks
    ids = np.zeros(T, np.int64)
    pos = np.zeros(T, np.int64)
    tables = np.zeros((B, M), np.int64)
    slots, logit_rows = [], []
    if c.model == "prefill":
        (p,) = run.pieces
        w = work[p.item]
        n, offset = p.count, p.start - w.start
        ids[:n] = np.asarray(w.token_ids[offset:offset + n], np.int64)
        pos[:] = p.start + np.arange(T)
        need = cdiv(p.start + n, bs)
        table = np.asarray(w.block_table[:need], np.int64)
        tables[0, :need], tables[0, need:] = table, table[0]
        slots = [table[q // bs] * bs + q % bs for q in range(p.start, p.start + n)]
        if p.logits:
            logit_rows.append((0, p.item))
        query_index = np.arange(T, dtype=np.int64)[None, :]
        token_index = np.arange(T, dtype=np.int64)
        logits_indices = np.array([n - 1], np.int64)
    else:
        for b, p in enumerate(run.pieces):
            w = work[p.item]
            ids[b] = w.token_ids[p.start - w.start]
            pos[b] = p.start
            need = cdiv(p.start + 1, bs)
            table = np.asarray(w.block_table[:need], np.int64)
            tables[b, :need], tables[b, need:] = table, table[0]
            slots.append(table[p.start // bs] * bs + p.start % bs)
            if p.logits:
                logit_rows.append((b, p.item))
        query_index = np.arange(B, dtype=np.int64)[:, None]
        token_index = np.arange(T, dtype=np.int64)
        logits_indices = np.arange(B, dtype=np.int64)
    assert query_index.shape == (B, Q)
    inputs = {"input_ids": ids[None, :], "position_ids": pos[None, :], "block_tables": tables,
              "query_index": query_index, "token_index": token_index, "logits_indices": logits_indices}
    real = np.asarray(slots, np.int64)
    if scratch is not None:
        _pack_inplace(run, inputs, real, scratch)
    elif readonly:
        _pack_lengths(run, inputs, before=True)
    return PackedRun(inputs, real, logit_rows)


def _pack_inplace(run: Run, inputs: dict[str, np.ndarray], real: np.ndarray, scratch: Scratch) -> None:
    """The in-place inputs of :func:`pack_run` (see there), added to ``inputs``; the gather ones adjusted."""
    c = run.choice
    inputs[SLOT_MAPPING] = np.concatenate([real, scratch.slots(c.num_tokens - len(real))])
    _pack_lengths(run, inputs, before=False)
    if c.model != "prefill":
        inputs["block_tables"][len(run.pieces):] = scratch.first


def _pack_lengths(run: Run, inputs: dict[str, np.ndarray], before: bool) -> None:
    """FIA's actual lengths per sequence (query tokens; the context after the run, or ``before`` it, at least 1:
    readonly), 1/1 for padding sequences; a prefill piece's padding rows at its last real position."""
    c = run.choice
    q_lens, kv_lens = np.ones(c.num_seqs, np.int64), np.ones(c.num_seqs, np.int64)
    for b, p in enumerate(run.pieces):
        q_lens[b], kv_lens[b] = p.count, max(p.start, 1) if before else p.start + p.count
    if c.model == "prefill":
        (p,) = run.pieces
        inputs["position_ids"][0, p.count:] = p.start + p.count - 1
    inputs[SEQ_LENS_Q], inputs[SEQ_LENS_KV] = q_lens, kv_lens


def pack_lora_slots(run: Run, work: Sequence[SeqWork], num_tokens: int) -> np.ndarray:
    """``lora_slots [1, num_tokens]`` of ``run`` in :func:`pack_run`'s row order: each real token's item's adapter
    slot (``SeqWork.lora_slot``), 0 (the base model: zeros in every pool) for the padding rows."""
    slots = np.zeros(num_tokens, np.int64)
    if run.choice.model == "prefill":
        (p,) = run.pieces
        slots[:p.count] = work[p.item].lora_slot
    else:
        for b, p in enumerate(run.pieces):
            slots[b] = work[p.item].lora_slot
    return slots[None, :]


class SlotPool(np.ndarray):
    """A host LoRA pool ``[slots, rows, columns]`` that records which slots were written since the executor last
    copied them to the device (``dirty``): the plan's adapter loads (runtime/lora/slots.py ``write_slot``) assign
    ``pool[slot] = …`` / ``pool[slot, rows, cols] = …``; a write through a view, or with any other first index,
    marks every slot."""

    dirty: set[int]

    def __new__(cls, shape: tuple[int, ...], dtype: np.dtype) -> SlotPool:
        obj = np.zeros(shape, dtype).view(cls)
        obj.dirty = set()
        return obj

    def __array_finalize__(self, obj: object) -> None:
        self._root = obj if isinstance(obj, SlotPool) and getattr(obj, "_root", None) is None else \
            getattr(obj, "_root", None)

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(key, value)
        root = self._root
        if root is not None:  # a view: which slots it covers is not tracked
            root.dirty.update(range(root.shape[0]))
            return
        first = key[0] if isinstance(key, tuple) and key else key
        if isinstance(first, (int, np.integer)):
            self.dirty.add(int(first) % self.shape[0])
        else:
            self.dirty.update(range(self.shape[0]))


@dataclass(frozen=True)
class CopyRun:
    """``rows`` consecutive new rows from model row ``src_row`` to pool slots ``dst_slot …``: one device copy."""

    src_row: int
    dst_slot: int
    rows: int


def slot_copy_plan(slots: Sequence[int] | np.ndarray) -> list[CopyRun]:
    """Coalesce the new rows' copies: row ``t`` goes to ``slots[t]``; rows whose slots are consecutive (a prefill
    chunk within a block, always) become one copy. Invariant: the runs cover rows ``0..len-1`` once, in order."""
    out: list[CopyRun] = []
    for t, s in enumerate(int(x) for x in slots):
        last = out[-1] if out else None
        if last is not None and last.dst_slot + last.rows == s:
            out[-1] = CopyRun(last.src_row, last.dst_slot, last.rows + 1)
        else:
            out.append(CopyRun(t, s, 1))
    return out


def as_dtype(array: np.ndarray, acl_dtype: int, name: str) -> np.ndarray:
    """``array`` in the model's input dtype, C-contiguous (indices may be compiled as int32, reference §5)."""
    dtype = ACL_DTYPES.get(acl_dtype)
    if dtype is None:
        raise AclModelMismatch(f"input '{name}': aclDataType {acl_dtype} has no host dtype here")
    return np.ascontiguousarray(array, dtype=dtype)
