"""Put the model's tokenizer beside an export: ``tokenizer.json`` (the ``tokenizers`` format) plus its metadata.

Hugging Face directories already carry ``tokenizer.json``; a GGUF file carries its vocabulary and merges
in metadata, converted once here with transformers' GGUF converter (a convert-time helper; serving reads
only ``tokenizer.json``). The chat template is kept verbatim.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from omforge.errors import OmforgeError
from omforge.export.weights import Checkpoint
from omforge.recipe import Recipe


class TokenizerError(OmforgeError):
    """The model's tokenizer cannot be found or converted; the message names the file."""


def write_tokenizer(recipe: Recipe, ckpt: Checkpoint, out_dir: Path) -> dict[str, Any]:
    """Write ``out_dir/tokenizer.json``; return the metadata (chat template, special tokens) for export.json.

    ``model.tokenizer``, where the recipe names one, is used whatever the source (it replaces the directory's
    tokenizer.json or the GGUF's vocabulary); the chat template and special tokens then come from its folder.
    Returns ``{"file": None, ...}`` when the model has no tokenizer (random weights without ``model.tokenizer``).
    """
    out = out_dir / "tokenizer.json"
    src = ckpt.source
    if recipe.model.tokenizer is not None:
        shutil.copyfile(recipe.model.tokenizer, out)
        return {"file": out.name, **_hf_tokenizer_meta(Path(recipe.model.tokenizer).parent)}
    if recipe.model.source == "random":
        return {"file": None, "chat_template": None, "bos_token": None, "eos_token": None}
    assert src is not None
    if src.is_dir():
        if not (src / "tokenizer.json").is_file():
            raise TokenizerError(f"{src}: no tokenizer.json (omforge reads the fast-tokenizer format)")
        shutil.copyfile(src / "tokenizer.json", out)
        return {"file": out.name, **_hf_tokenizer_meta(src)}
    return {"file": out.name, **_convert_gguf_tokenizer(src, out)}


def _hf_tokenizer_meta(directory: Path) -> dict[str, Any]:
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    def token(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    return {"chat_template": template, "bos_token": token(cfg.get("bos_token")),
            "eos_token": token(cfg.get("eos_token"))}


def _convert_gguf_tokenizer(gguf_path: Path, out: Path) -> dict[str, Any]:
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_path))
        fast, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as e:  # transformers raises many kinds here; the message is what matters
        raise TokenizerError(f"{gguf_path}: cannot convert the GGUF tokenizer ({type(e).__name__}: {e})") from None
    fast.save(str(out))
    return {"chat_template": tokenizer_config.get("chat_template"), "bos_token": tokenizer_config.get("bos_token"),
            "eos_token": tokenizer_config.get("eos_token")}
