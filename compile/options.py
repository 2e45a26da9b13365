"""The passes' LoRA and pooling options (passes/options.py) built once from the recipe and the export's metadata,
for the compile (compile/compiler.py hands them to the ort build or the ascend stage) and ``omforge verify``'s plain
twin (the same options, so the twin is the bundle's graph). A recipe value the export contradicts is an
OmforgeError naming the recipe key."""

from __future__ import annotations

from pathlib import Path

from omforge.contract.lora import ATTENTION_MODULES
from omforge.contract.manifest import ModelConfig
from omforge.errors import OmforgeError
from omforge.passes.options import LoraOptions, PoolingOptions
from omforge.recipe import Recipe


def lora_options(recipe: Recipe, config: ModelConfig) -> LoraOptions | None:
    """``compile.lora`` with the export's model ``config`` (the column widths of fused projections); None without
    LoRA. A mixture of experts' MLP is its experts, which take no LoRA term (per-expert adapters are not built): its
    default targets are the attention projections, and an MLP module named in ``target_modules`` is a one-line
    error."""
    lora = recipe.compile.lora
    if lora is None:
        return None
    targets = tuple(lora.target_modules)
    if config.is_moe:
        mlp = [m for m in targets if m not in ATTENTION_MODULES]
        if mlp and "target_modules" in lora.model_fields_set:
            raise OmforgeError(f"{recipe.path}: compile.lora.target_modules: {', '.join(mlp)}: a mixture of experts' "
                               "MLP is its experts, which take no LoRA term (per-expert adapters are not built); "
                               f"target {', '.join(ATTENTION_MODULES)}")
        targets = tuple(m for m in targets if m in ATTENTION_MODULES)
    return LoraOptions(lora.max_loras, lora.max_rank, targets, config)


def pooling_options(recipe: Recipe, export_dir: Path, config: ModelConfig) -> PoolingOptions | None:
    """The pooling insertion's options for a pooling recipe (None: task generate): the task and, for score, the
    ``[no, yes]`` token ids — given as ids or as token strings of the export's tokenizer (one line naming the key
    when a string is no token of it, or an id is outside the vocabulary)."""
    if recipe.task == "generate":
        return None
    p = recipe.pooling
    if recipe.task == "embed":
        if p is not None and p.append_eos and not config.eos_token_ids:
            raise OmforgeError(f"{recipe.path}: pooling.append_eos: the model config names no EOS token")
        return PoolingOptions("embed")
    ids = []
    for key in ("no_token", "yes_token"):
        token = getattr(p, key)
        if isinstance(token, str):
            path = export_dir / "tokenizer.json"
            if not path.is_file():
                raise OmforgeError(f"{recipe.path}: pooling.{key}: '{token}' is a token string but the model has "
                                   "no tokenizer; give the token id")
            from tokenizers import Tokenizer

            found = Tokenizer.from_file(str(path)).token_to_id(token)
            if found is None:
                raise OmforgeError(f"{recipe.path}: pooling.{key}: '{token}' is not a token of the tokenizer")
            token = found
        if not 0 <= token < config.vocab_size:
            raise OmforgeError(f"{recipe.path}: pooling.{key}: {token} is outside the vocabulary "
                               f"(0..{config.vocab_size - 1})")
        ids.append(token)
    return PoolingOptions("score", (ids[0], ids[1]))
