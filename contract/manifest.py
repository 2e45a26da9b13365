"""The bundle's manifest: ONE typed schema (:class:`Manifest` and its sections) that compile writes and the runtime
reads through the same code — :meth:`Section.to_dict` / :meth:`Section.from_dict`, an exact round trip of
manifest.json — and :func:`load_manifest`, which also checks every listed file's size and SHA-256.
Dependency-free: stdlib, omforge.errors and the contract's own types only.

A section is a frozen dataclass whose field names are the JSON keys, in the file's order. Reading is strict: a
missing required field, an unknown one or a value of the wrong kind is a :class:`BundleError` naming the field
(``kv.block_size``). Fields added after the first bundles (``paged_attention``, ``kernels``, ``weights``,
``export``) have defaults, so those bundles load; sections free-form by nature (the serve defaults, the quantized
matrices) stay dicts. The model config is typed (:class:`ModelConfig`): the runtime reads its facts as attributes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Self, Union

from omforge.contract import PagedLayout
from omforge.contract.buckets import BucketError, BucketPlan
from omforge.contract.pooling import TASKS
from omforge.errors import OmforgeError

SCHEMA_VERSION = 1
POOLING_TASKS = tuple(t for t in TASKS if t != "generate")
MANIFEST = "manifest.json"
TARGETS = ("ort", "ascend")

OMIT_IF_NONE = {"omit_if_none": True}
"""Field metadata: the key is absent from the JSON while the value is None (what only some bundles have)."""


class BundleError(OmforgeError):
    """A bundle that cannot be used: the message names the bundle and the file or field."""


class Section:
    """A manifest section (subclasses are frozen dataclasses): read and written by the one schema below."""

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> Self:
        """The section from its JSON form; ``where`` prefixes the field names in errors (``kv``)."""
        return _read_section(cls, data, where)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, keys in field order: ``from_dict(x.to_dict()) == x``."""
        return _write(self)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
"""Mixtures of experts: every layer's FFN is a sparse MoE block (:attr:`ModelConfig.num_experts` > 0)."""
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
"""``freq_factors``: ``{"rope_type": "freq_factors", "factors": [head_dim // 2 floats]}``, the per-frequency divisors a
GGUF carries as ``rope_freqs.weight`` (llama.cpp's convert_hf_to_gguf.py writes them for Llama 3's ``llama3``
scaling, whose parameters the GGUF does not keep); ``inv_freq[i] = default inv_freq[i] / factors[i]``, as ggml's
rope divides theta by ``freq_factors[i]`` (ggml-cpu/ops.cpp, ``ggml_rope_cache_init``)."""


class ConfigError(OmforgeError):
    """A model configuration that omforge cannot build; the message names the field."""


@dataclass(frozen=True)
class ModelConfig(Section):
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral): what export builds
    from a config.json or a recipe (models/config.py) or GGUF metadata (export/weights.py), export.json and the
    manifest record and the runtime reads (vocabulary, EOS ids, sliding window, …). Qwen3 is the one family with
    per-head q/k norms (:attr:`qk_norm`, implied by the family, so no field of its own).

    Invariants (:class:`ConfigError` naming the field): the sizes are positive integers; ``num_attention_heads %
    num_key_value_heads == 0`` (GQA groups are whole); ``head_dim`` is even (rotary pairs); ``rope_scaling`` is None
    or a dict whose ``rope_type`` is one of :data:`ROPE_TYPES` (``freq_factors``: ``factors`` is a list of
    ``head_dim // 2`` positive finite numbers). Read from JSON (:meth:`from_dict`), a missing
    required field or a broken invariant is a :class:`BundleError` naming ``model.config.<field>``."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a mixture of experts (:data:`MOE_FAMILIES`; 0 for a dense model): every layer routes each token to
    # ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, weighted by the
    # router's softmax (renormalized over the chosen ones when ``norm_topk_prob``; Mixtral always)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"family: '{self.family}' is not supported; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer (got {value!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: must be even for rotary embeddings (got {self.head_dim})")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling: type {self.rope_scaling.get('rope_type')!r} is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "freq_factors":
            _check_freq_factors(self.rope_scaling.get("factors"), self.head_dim // 2)
        self._check_experts()

    def _check_experts(self) -> None:
        """A MoE family has ``2 <= num_experts``, ``1 <= num_experts_per_tok <= num_experts`` and a positive
        ``moe_intermediate_size``; a dense family has ``num_experts == 0``."""
        if self.family not in MOE_FAMILIES:
            if self.num_experts:
                raise ConfigError(f"num_experts: family '{self.family}' is dense (got {self.num_experts}); "
                                  f"mixtures of experts: {', '.join(MOE_FAMILIES)}")
            return
        if not _is(int, self.num_experts) or self.num_experts < 2:
            raise ConfigError(f"num_experts: a mixture of experts needs at least 2 (got {self.num_experts!r})")
        k = self.num_experts_per_tok
        if not _is(int, k) or not 1 <= k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok: must be between 1 and num_experts ({self.num_experts}), "
                              f"got {k!r}")
        if not _is(int, self.moe_intermediate_size) or self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size: must be a positive integer (got {self.moe_intermediate_size!r})")

    @property
    def is_moe(self) -> bool:
        """Every layer's FFN is a sparse MoE block."""
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k (weights ``[head_dim]``, eps ``rms_norm_eps``) after the projections and
        before rotary: Qwen3's ``q_norm`` / ``k_norm``."""
        return self.family in ("qwen3", "qwen3_moe")

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> ModelConfig:
        """The config from its JSON form (:meth:`to_dict`'s); a broken invariant is a :class:`BundleError` too."""
        try:
            return _read_section(cls, data, where)
        except ConfigError as e:
            raise BundleError(_at(where, str(e))) from None


def _check_freq_factors(factors: Any, n: int) -> None:
    """``rope_scaling.factors`` of a ``freq_factors`` scaling: a list of ``n`` positive finite numbers."""
    if not isinstance(factors, list) or len(factors) != n:
        got = f"{len(factors)} items" if isinstance(factors, list | tuple) else repr(factors)
        raise ConfigError(f"rope_scaling.factors: expected a list of head_dim / 2 = {n} numbers, got {got}")
    bad = [f for f in factors if not _is(float, f) or not 0 < f < float("inf")]
    if bad:
        raise ConfigError(f"rope_scaling.factors: every factor must be a positive finite number (got {bad[0]!r})")


@dataclass(frozen=True)
class ModelSection(Section):
    """The model: the recipe's name and its config."""

    name: str
    config: ModelConfig


@dataclass(frozen=True)
class TokenizerMeta(Section):
    """The tokenizer: its file, relative to the bundle (None: the model has none, e.g. random test weights), the
    chat template and the special tokens the template renders. export.json's ``tokenizer`` entry has this form."""

    file: str | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None


@dataclass(frozen=True)
class TensorSpec(Section):
    """One graph input or output: name, element type (ONNX's, lowercased: float, int64, …) and shape, symbolic
    dims by name."""

    name: str
    dtype: str | None
    shape: tuple[int | str, ...] | None


@dataclass(frozen=True)
class StepAbi(Section):
    """The step graph's inputs and outputs in graph order (the step ABI: contract/__init__.py's names)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class KernelLibrary(Section):
    """The CPU kernel library an ort step graph calls (paged attention lowered to it): the library's file stem, its
    op domain and ABI version, the ISA path it was compiled with, and — when weight MatMuls are lowered to its
    ``MatMulQ`` — the version of the packed weight layout they are stored in (runtime/ort/kernels/qgemm.h)."""

    name: str | None
    domain: str
    abi: int | None
    isa: str | None
    weight_layout: int | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class KvSection(Section):
    """The KV pools: :class:`PagedLayout`'s fields (``dtype`` is its ``kv_dtype``), the pools' shape in words
    (``layout``), the bytes one token takes in every layer's K and V, and how the graph writes new rows.
    Invariant: ``bytes_per_token == paged_layout.bytes_per_token``."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    layout: str
    bytes_per_token: int
    write: str

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16", "int8"):
            raise BundleError(f"kv.dtype: {self.dtype!r} is not a KV pool dtype (float32, float16, bfloat16, int8)")
        if self.bytes_per_token != self.paged_layout.bytes_per_token:
            raise BundleError(f"kv.bytes_per_token: {self.bytes_per_token} disagrees with the layout's "
                              f"{self.paged_layout.bytes_per_token}")

    @classmethod
    def of(cls, layout: PagedLayout, write: str) -> KvSection:
        shape = ("head_dim + 4] int8 (each head's row, then its float32 scale)" if layout.kv_dtype == "int8"
                 else "head_dim]")
        return cls(layout.num_layers, layout.kv_heads, layout.head_dim, layout.block_size, layout.kv_dtype,
                   f"[num_blocks, block_size, kv_heads, {shape} per layer, K and V", layout.bytes_per_token, write)

    @property
    def paged_layout(self) -> PagedLayout:
        return PagedLayout(self.num_layers, self.kv_heads, self.head_dim, self.block_size, self.dtype)


@dataclass(frozen=True)
class PoolingSection(Section):
    """A pooling bundle (recipe ``task: embed | score``; contract/pooling.py has its step ABI): the task, the
    pooling (``last``: the last token's position), the graph output it reads and that output's width
    (``hidden_size``, or 2: the ``no`` and ``yes`` logits), whether embeddings are L2-normalized, whether a shorter
    ``dimensions`` may be asked (``matryoshka``: truncate, then normalize), the token appended to text inputs
    (``append_token_id``, None: none), the score's ``[no, yes]`` token ids, and the prompt format and default
    instruction the server writes queries and documents with."""

    task: str
    pooling: str
    output: str
    size: int
    normalize: bool
    matryoshka: bool
    append_token_id: int | None
    score_token_ids: tuple[int, int] | None
    prompt_format: str
    instruction: str | None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise BundleError(f"pooling.task: {self.task!r} is not one of {', '.join(POOLING_TASKS)}")
        if (self.task == "score") != (self.score_token_ids is not None):
            raise BundleError("pooling.score_token_ids: present exactly in a score bundle")


@dataclass(frozen=True)
class LoraPart(Section):
    """One target module's share of a LoRA'd projection: output columns ``[start, stop)`` (contract/lora.py)."""

    target: str
    start: int
    stop: int


@dataclass(frozen=True)
class LoraProjection(Section):
    """A projection of the step graph that carries a LoRA term: its layer, short name (contract/lora.py
    ``PROJECTIONS``), input and output widths, and its parts in rank order (pool inputs ``lora_a.{layer}.{name}``,
    ``lora_b.{layer}.{name}``)."""

    layer: int
    name: str
    in_features: int
    out_features: int
    parts: tuple[LoraPart, ...]


@dataclass(frozen=True)
class LoraSection(Section):
    """A bundle compiled with ``compile.lora`` (docs/lora.md): adapter slots (the pools hold ``max_loras + 1``, slot 0
    the base model), the rank every slot is padded to, the target modules, and every LoRA'd projection."""

    max_loras: int
    max_rank: int
    target_modules: tuple[str, ...]
    projections: tuple[LoraProjection, ...]

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1


@dataclass(frozen=True)
class Limits(Section):
    """The build-time maxima the step graph (and an ascend bundle's gears) was compiled for."""

    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int


@dataclass(frozen=True)
class PassCounts(Section):
    """What the passes did: rewrites per fusion (contract ``FUSIONS`` names), the final graph's node count and its
    op histogram (``domain::op`` outside the default domain)."""

    fusion_counts: dict[str, int]
    num_nodes: int
    op_histogram: dict[str, int]


@dataclass(frozen=True)
class Weights(Section):
    """The weights' precision (recipe ``compile.weights``) and every quantized matrix (name → bits, block, source);
    ort: the accuracy level (None: not quantized, or bfloat16 activations), the op the quantized MatMuls are
    (``gemm``: ``MatMulQ`` or ``MatMulQBF16``, omforge's kernels, or ``MatMulNBits``; absent in bundles from before
    the kernel) and their activation type (``activations``: int8, bfloat16 or float32; absent in bundles from
    before the recipe key and for ORT's levels 1–3); ascend only: the graph's float type (``graph``) and, for int8,
    what the W8A16 lowering is (``w8a16``)."""

    precision: str
    quantized: dict[str, Any]
    accuracy_level: int | None = None
    gemm: str | None = field(default=None, metadata=OMIT_IF_NONE)
    activations: str | None = field(default=None, metadata=OMIT_IF_NONE)
    graph: str | None = field(default=None, metadata=OMIT_IF_NONE)
    w8a16: dict[str, str] | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class Graphs(Section):
    """The bundle's graphs, relative to it: ``step``, the one the runtime loads; ``unfused`` only in bundles from
    before the export stayed in the stage cache (nothing reads it)."""

    step: str
    unfused: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class ExportRef(Section):
    """Where the unfused export lives (the stage cache: the bundle holds no second copy of the weights; ``omforge
    export RECIPE -o DIR`` rebuilds it) and the recipe digest it was made for."""

    recipe_digest: str
    dir: str
    note: str


ACL_LOAD_PATH = ("acl.mdl.load_with_config from file with ACL_MDL_WORKSPACE_MEM_OPTIMIZE = 1: GE's work memory "
                 "holds no copy of the model's inputs and outputs, so the KV pool and the step buffers count once")
"""The load the device memory plans assume (runtime/ascend/acl_api.py loads so; reference/ascend.md §5.2). Loaded
with ``acl.mdl.load_from_file`` instead, GE reserves every input and output again: the pool would count twice."""


@dataclass(frozen=True)
class DeviceMemoryPlan(Section):
    """What an ascend bundle needs of the device, in bytes (compile/ascend/stages.py ``memory_plan``): the weights once,
    the KV pool once, the step's buffers at the largest gear, an estimate of the OM's own workspace (without its
    inputs and outputs), their total — on the load path ``load`` (:data:`ACL_LOAD_PATH`; bundles from before it
    was recorded were planned by the same sum)."""

    soc_version: str
    om_models: int
    gears: int
    weights_bytes: int
    kv_pool_bytes: int
    io_bytes: int
    workspace_bytes_estimate: int
    total_bytes: int
    note: str
    load: str = ACL_LOAD_PATH


@dataclass(frozen=True)
class AscendSection(Section):
    """What the ACL executor needs beyond the ABI: the one OM's ``--output`` prefix (ATC may add ``_<os>_<cpu>``),
    the inputs ATC's ``--input_shape`` lists, in order, with their dims (they make each gear's dims list), the OM's
    gears over ``gear_dims``, the pool's slot count (static in the graph), SoC and precision mode, whether ATC
    ran (``done`` | ``left``), omforge's fusion switches (nothing of ours goes to ATC) and the memory plan."""

    model: str
    input_shape: tuple[tuple[str, tuple[int | str, ...]], ...]
    gears: tuple[tuple[int, ...], ...]
    gear_dims: tuple[str, ...]
    num_slots: int
    soc_version: str
    precision_mode: str
    atc: str
    fusions: dict[str, bool]
    memory: DeviceMemoryPlan
    paged_attention: str = "gather"
    """``inplace`` | ``readonly`` | ``gather`` (:data:`omforge.contract.ascend.PAGED_ATTENTION_MODES`); bundles from
    before the modes were gather bundles."""
    paged_attention_note: str = ""
    """Why this mode: the recipe chose it, or the SoC's kernels decided (a fallback names the missing kernel)."""
    ref_inputs: tuple[str, ...] = ()
    """The inputs the OM declares ``RefData``: its ref ops update the caller's buffer in place (the in-place pools)."""
    scratch_blocks: int = 0
    """The pool's last blocks, where a gear's padding rows are written: never handed to the block pool."""
    cann_release: str = ""
    """The CANN release the ascend path targets: the one whose open sources docs/ascend-conformance.md cites."""


@dataclass(frozen=True)
class FileEntry(Section):
    """One file of the bundle: its size in bytes and SHA-256 (hex)."""

    size: int
    sha256: str


def _float32_weights() -> Weights:
    return Weights("float32", {})


@dataclass(frozen=True, kw_only=True)
class Manifest(Section):
    """manifest.json: what the runtime needs to load a bundle, and where each part came from. ``serve``: the
    recipe's serve section (runtime/engine_config.py resolves it; a key absent there means "the default").
    ``ascend`` is present exactly in ascend bundles; ``kernels`` where paged attention is lowered to the kernel
    library (``paged_attention`` ``kernel``, else ``plain``); ``kv`` in a generate bundle, ``pooling`` instead in
    a pooling bundle (task embed | score: no KV pool); ``lora`` in a bundle compiled with ``compile.lora``
    (docs/lora.md). ``files``: every file but the manifest, by path."""

    schema_version: int = SCHEMA_VERSION
    omforge_version: str
    model: ModelSection
    tokenizer: TokenizerMeta
    target: str
    abi: StepAbi
    paged_attention: str = "plain"
    kernels: KernelLibrary | None = None
    kv: KvSection | None
    pooling: PoolingSection | None = field(default=None, metadata=OMIT_IF_NONE)
    lora: LoraSection | None = field(default=None, metadata=OMIT_IF_NONE)
    limits: Limits
    serve: dict[str, Any]
    buckets: BucketPlan
    passes: PassCounts
    weights: Weights = field(default_factory=_float32_weights)
    graphs: Graphs
    export: ExportRef | None = field(default=None, metadata=OMIT_IF_NONE)
    ascend: AscendSection | None = field(default=None, metadata=OMIT_IF_NONE)
    toolchain: dict[str, str]
    timings: dict[str, float]
    files: dict[str, FileEntry]

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise BundleError(f"target: {self.target!r} is not one of {', '.join(TARGETS)}")
        if (self.kv is None) == (self.pooling is None):
            raise BundleError("kv: a generate bundle has a KV pool, a pooling bundle (pooling section) none; this "
                              f"manifest has {'neither' if self.kv is None else 'both'}")
        if (self.target == "ascend") != (self.ascend is not None):
            raise BundleError(f"ascend: {'missing' if self.ascend is None else 'present'} in an {self.target} "
                              "bundle (an ascend bundle has this section, and only it)")

    @property
    def task(self) -> str:
        """``generate``, or the pooling bundle's task (``embed`` | ``score``)."""
        return self.pooling.task if self.pooling is not None else "generate"

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> Manifest:
        """The manifest from manifest.json's content: its schema version first, then every field."""
        if not isinstance(data, dict):
            raise BundleError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BundleError(f"schema_version {version!r} is not supported by this omforge (supports "
                              f"{SCHEMA_VERSION}); recompile the bundle")
        asc = data.get("ascend")
        if isinstance(asc, dict) and "models" in asc and "model" not in asc:
            raise BundleError("an ascend bundle from before issue 20 (one OM per profile, per-layer pools, every "
                              "input in --input_shape: it would not load on an NPU); recompile it")
        return _read_section(cls, copy.deepcopy(data), where)


def load_manifest(bundle: Path, verify: bool = True) -> Manifest:
    """Read and check a bundle's manifest. ``verify`` re-hashes every listed file (about a second per GB)."""
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a directory (expected a bundle written by omforge compile)")
    if not path.is_file():
        raise BundleError(f"{bundle}: no {MANIFEST} (not a bundle, or its compile did not finish)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        manifest = Manifest.from_dict(data)
    except BundleError as e:
        raise BundleError(f"{path}: {e}") from None
    for rel, entry in manifest.files.items():
        f = bundle / rel
        if not f.is_file():
            raise BundleError(f"{bundle}: file '{rel}' listed in the manifest is missing")
        if f.stat().st_size != entry.size:
            raise BundleError(f"{bundle}: file '{rel}' was modified (size {f.stat().st_size}, manifest says "
                              f"{entry.size}); recompile the bundle")
        if verify and file_sha256(f) != entry.sha256:
            raise BundleError(f"{bundle}: file '{rel}' was modified (SHA-256 differs from the manifest); "
                              f"recompile the bundle")
    return manifest


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --- the one schema, both ways ----------------------------------------------------------------------------------

@cache
def _schema(cls: type) -> tuple[tuple[Field, Any], ...]:
    """``cls``'s fields with their resolved types (the annotations are strings here)."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in fields(cls))


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _read_section(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise _wrong(where or "manifest", "an object", data)
    schema = _schema(cls)
    names = [f.name for f, _ in schema]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise BundleError(f"{_at(where, unknown[0])}: unknown field (known here: {', '.join(names)})")
    values = {}
    for f, kind in schema:
        if f.name in data:
            values[f.name] = _read(kind, data[f.name], _at(where, f.name))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise BundleError(f"{_at(where, f.name)}: missing (a required field)")
    return cls(**values)


def _read(kind: Any, value: Any, where: str) -> Any:
    """``value`` (JSON) as ``kind``: sections, X | None, tuple[X, ...], fixed tuples, dict[str, X], int, float,
    str, bool, Any; lists become tuples."""
    if kind is Any:
        return value
    if kind is BucketPlan:
        try:
            return BucketPlan.from_dict(value)
        except BucketError as e:
            raise BundleError(str(e)) from None
    if isinstance(kind, type) and issubclass(kind, Section):
        return kind.from_dict(value, where)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _read(options[0], value, where)
        if any(_is(a, value) for a in options):  # int | str: scalars only
            return value
        raise _wrong(where, " or ".join(a.__name__ for a in options), value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _wrong(where, "a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise BundleError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_read(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong(where, "an object", value)
        return {k: _read(args[1], v, f"{where}['{k}']") for k, v in value.items()}
    if not _is(kind, value):
        raise _wrong(where, kind.__name__, value)
    return value


def _is(kind: type, value: Any) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _wrong(where: str, expected: str, value: Any) -> BundleError:
    shown = repr(value) if len(repr(value)) <= 60 else type(value).__name__
    return BundleError(f"{where}: expected {expected}, got {shown}")


def _write(value: Any) -> Any:
    if isinstance(value, BucketPlan):
        return value.to_dict()
    if isinstance(value, Section):
        return {f.name: _write(v) for f, _ in _schema(type(value))
                if (v := getattr(value, f.name)) is not None or not f.metadata.get("omit_if_none")}
    if isinstance(value, list | tuple):
        return [_write(v) for v in value]
    if isinstance(value, dict):
        return {k: _write(v) for k, v in value.items()}
    return value
