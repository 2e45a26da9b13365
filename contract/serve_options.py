"""The serve options, each declared once — its name, type, default, range and help — for the three places that take
them: the recipe's ``serve`` section (recipe.py builds its schema from :data:`SERVE_OPTIONS`; compile writes the
section into the manifest), ``omforge serve``'s flags (cli.py adds one per option, ``--max-num-seqs`` for
``max_num_seqs``) and the engine's overrides (runtime/engine_config.py takes these names, and a key a bundle's serve
section lacks — a bundle compiled before the option existed — means this default).

Names are vLLM's where it has the knob (SGLang's for the tiers below the pool); docs/recipes.md maps them to MindIE's.
A default of None means "resolved by the engine" (``num_kv_blocks`` from ``kv_cache_space_gb``, …) as the help
says. Dependency-free: the recipe, the command line and the runtime import it without the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVE_GROUPS: tuple[tuple[str, str], ...] = (
    ("model", "what runs: the context, decoding, reasoning, threads"),
    ("scheduling", "the batch, the step and the queue"),
    ("KV and tiers", "the KV pool, preemption and the tiers below it"),
    ("PD", "prefill/decode disaggregation"),
    ("LoRA", "adapters served beside the base model"),
    ("API", "what clients see: the key, the model name, tool calls"),
    ("HTTP", "the listening socket, timeouts, limits, shutdown, logging"),
)
"""``omforge serve --help``'s argument groups, in order: (title, description). Every serve option names one
(``ServeOption.group``); cli.py puts its own flags (``--host``, ``--api-key`` …) in the API and HTTP groups."""
GROUP_NAMES = tuple(title for title, _ in SERVE_GROUPS)


@dataclass(frozen=True)
class ServeOption:
    """One serve option. ``kind``: the value's type (int, float, bool, str, dict: JSON on the command line, or list:
    of str, with ``nargs``);
    ``nullable``: None is a value of the recipe (null); ``choices``: the only values allowed; ``words``: besides a
    positive number, the words allowed (``auto``); ``ge`` / ``gt`` / ``le``: the recipe's range; ``flag``: the
    command-line flag when it is not the name's (``--max-queue-time``), None for an option the command line does not
    take; ``recipe``: False for an option of the command line (and the engine) only, not of the recipe; ``nargs``:
    ``+`` for a dict option whose flag takes one or more ``NAME=VALUE`` words (``--lora-modules a=/p b=/q``) or a
    list option's words (``--lora-dirs A B``); ``group``: its group of ``omforge serve --help`` (:data:`SERVE_GROUPS`).
    """

    name: str
    kind: type
    default: Any
    help: str
    group: str
    nullable: bool = False
    choices: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    flag: str | None = ""
    metavar: str | None = None
    recipe: bool = True
    nargs: str | None = None  # the flag takes several words (``+``): a dict option's NAME=VALUE pairs, a list's items

    def __post_init__(self) -> None:
        if self.group not in GROUP_NAMES:
            raise ValueError(f"serve option {self.name}: group {self.group!r} is not one of {GROUP_NAMES}")

    @property
    def cli_flag(self) -> str | None:
        """The command-line flag: ``flag``, or the name with dashes (``--max-num-seqs``); None: no flag."""
        return None if self.flag is None else self.flag or "--" + self.name.replace("_", "-")


SERVE_OPTIONS: tuple[ServeOption, ...] = (
    ServeOption("max_num_seqs", int, 64, "sequences running at once (vLLM max_num_seqs, MindIE maxBatchSize)",
                ge=1, le=4096, group="scheduling"),
    ServeOption("max_num_batched_tokens", int, 512, "token budget of one step (vLLM max_num_batched_tokens, MindIE "
                "maxPrefillTokens)", ge=16, le=1_048_576, group="scheduling"),
    ServeOption("max_prefill_tokens_with_decodes", int, "auto", "prefill tokens in a step with decodes: a number, "
                "auto = when serving a 128-token budget for the whole step (float32 weights: 64 prefill tokens, fewer "
                "where a step would last over ~mixed_step_time_ratio times its decodes alone, as timed by the engine), "
                "none = no bound", nullable=True, words=("auto",), ge=1, le=1_048_576, metavar="N|auto|none",
                group="scheduling"),
    ServeOption("mixed_step_time_ratio", float, 3.0, "the time rule of auto on float32 weights: a step with decodes "
                "lasts at most about this many times its decodes alone (runtime/step_cost.py); lower keeps the "
                "inter-token tail down, at the cost of TTFT while streams decode", gt=1, le=100, metavar="RATIO",
                group="scheduling"),
    ServeOption("max_model_len", int, None, "longest prompt + output admitted, at most compile.max_seq_len (default: "
                "it; vLLM max_model_len, MindIE maxSeqLen)", nullable=True, ge=16, group="model"),
    ServeOption("enable_prefix_caching", bool, True, "reuse the KV blocks of shared prefixes (vLLM "
                "enable_prefix_caching)", group="KV and tiers"),
    ServeOption("max_queue_delay_us", int, 2000, "how long a first step waits for companions while the batch is not "
                "full, in microseconds (MindIE maxQueueDelayMicroseconds)", ge=0, le=10_000_000, group="scheduling"),
    ServeOption("preemption_mode", str, "recompute", "what frees KV blocks when they run out (vLLM preemption_mode)",
                choices=("swap", "recompute"), group="KV and tiers"),
    ServeOption("swap_space_gb", float, 1.0, "the host swap tier of preemption_mode swap, in GiB (vLLM swap_space)",
                ge=0, le=1024, flag="--swap-space", metavar="GB", group="KV and tiers"),
    ServeOption("num_kv_blocks", int, None, "the KV pool's size in blocks (default: from kv_cache_space_gb; vLLM "
                "num_gpu_blocks_override)", nullable=True, ge=2, group="KV and tiers"),
    ServeOption("kv_cache_space_gb", float, None, "the KV pool's budget in GiB when no block count is given (default "
                "2; vLLM's VLLM_CPU_KVCACHE_SPACE)", nullable=True, gt=0, le=4096, group="KV and tiers"),
    ServeOption("speculative_config", dict, None, 'speculative decoding, vLLM\'s spelling, e.g. {"method": "ngram", '
                '"num_speculative_tokens": 4}', nullable=True, metavar="JSON", group="model"),
    ServeOption("max_waiting_requests", int, None, "sequences waiting beyond max_num_seqs before the server answers "
                "429 (default: as many as are predicted to start within 0.8 × max_queue_time_s, from the measured "
                "pace or the requests' max_tokens and the engine's step times; given: a hard cap)", nullable=True, ge=1,
                le=1_000_000, group="scheduling"),
    ServeOption("max_queue_time_s", float, 60.0, "a request still waiting after this many seconds ends with a "
                "retryable 503 (a recipe's null: no bound)", nullable=True, gt=0, le=86_400, flag="--max-queue-time",
                metavar="SECONDS", group="scheduling"),
    ServeOption("enable_hierarchical_cache", bool, False, "keep prefix-cache blocks below the KV pool (the tiers "
                "below; SGLang's HiCache; docs/hicache.md)", group="KV and tiers"),
    ServeOption("hicache_size_gb", float, None, "the host-memory tier (L2) for pools in device memory, in GiB; off on "
                "ort (its pool is host memory)", nullable=True, ge=0, le=65_536, flag="--hicache-size",
                metavar="GB", group="KV and tiers"),
    ServeOption("hicache_storage_backend", str, None, "the storage tier (L3): file, files in a directory",
                nullable=True, choices=("file",), group="KV and tiers"),
    ServeOption("hicache_storage_dir", str, None, "the storage tier's directory (may be shared by replicas; "
                "survives restarts)", nullable=True, metavar="DIR", group="KV and tiers"),
    ServeOption("hicache_storage_size_gb", float, None, "the storage tier's budget per bundle in GiB (default 16), "
                "least recently used out first", nullable=True, gt=0, le=1_048_576, flag="--hicache-storage-size",
                metavar="GB", group="KV and tiers"),
    ServeOption("reasoning_parser", str, None, "split a reasoning model's thinking (<think> … </think>) from its "
                "answer into reasoning_content (vLLM's --reasoning-parser)", nullable=True,
                choices=("qwen3", "deepseek_r1"), group="model"),
    ServeOption("reasoning_budget", int, None, "thinking tokens after which </think> is forced, for a request that "
                "sends no thinking_token_budget (llama.cpp --reasoning-budget; default: no cap)", nullable=True, ge=0,
                metavar="N", group="model"),
    ServeOption("lora_modules", dict, None, "LoRA adapters served beside the base model, NAME=PATH each (a PEFT "
                "directory or a GGUF LoRA file); a request's model selects one (vLLM --lora-modules; the bundle needs "
                "compile.lora)", nullable=True, metavar="NAME=PATH", recipe=False, nargs="+", group="LoRA"),
    ServeOption("max_loras", int, None, "LoRA adapters resident at once, 1 … the bundle's compile.lora.max_loras "
                "(default: that; vLLM --max-loras)", nullable=True, ge=1, le=64, metavar="N", recipe=False,
                group="LoRA"),
    ServeOption("max_cpu_loras", int, None, "LoRA adapters registered at once, --lora-modules included; a load past "
                "it is refused (default: the larger of 16, --max-loras and the --lora-modules given; vLLM "
                "--max-cpu-loras)", nullable=True, ge=1, le=100_000, metavar="N", recipe=False, group="LoRA"),
    ServeOption("enable_runtime_lora", bool, False, "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                "(off: a 404 saying how to turn it on; also on with OMFORGE_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM's "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs --lora-dirs", recipe=False, group="LoRA"),
    ServeOption("lora_dirs", list, None, "the directories runtime loads may read adapters from (a lora_path must "
                "resolve inside one, symlinks and .. followed; a relative one is looked up in each)", nullable=True,
                metavar="DIR", recipe=False, nargs="+", group="LoRA"),
    ServeOption("threads", int, None, "onnxruntime intra-op threads (default: all cores)", nullable=True,
                recipe=False, group="model"),
    ServeOption("kv_transfer_config", str, None, 'prefill/decode disaggregation over NIXL, vLLM\'s flag: '
                '\'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"|"kv_consumer"|"kv_both"}\' '
                "(docs/pd.md; needs .[cluster])", nullable=True, metavar="JSON", recipe=False, group="PD"),
)
"""Every serve option, the recipe's in the order of its ``serve`` section."""

RECIPE_OPTIONS = tuple(o for o in SERVE_OPTIONS if o.recipe)
"""The recipe's ``serve`` keys."""
