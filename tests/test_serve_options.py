"""Every serve option is declared once (contract/serve_options.py) and the recipe's ``serve`` schema, ``omforge
serve``'s flags and the engine's options all come from that declaration (issue 45 item 4): the same names, the
recipe's defaults, ranges and choices, the same help, and a bundle compiled before an option existed takes its
declared default."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from test_engine_config import manifest

from omforge import cli
from omforge.contract.serve_options import RECIPE_OPTIONS, SERVE_OPTIONS, ServeOption
from omforge.recipe import ServeSection
from omforge.runtime.engine_config import CALLER_OPTIONS, EngineConfig

DERIVED = {"num_host_blocks", "explicit_kv_blocks", "explicit_waiting", "float32_weights"}  # resolved, not options


def serve_parser() -> argparse.ArgumentParser:
    sub = cli.build_parser()._subparsers._group_actions[0]  # the subcommands
    return sub.choices["serve"]


def sample(o: ServeOption) -> tuple[list[str], Any]:
    """A flag's command-line words for ``o`` and the value the engine then gets."""
    if o.kind is bool:
        return [o.cli_flag], True
    if o.choices:
        return [o.cli_flag, o.choices[-1]], o.choices[-1]
    if o.words:
        return [o.cli_flag, o.words[0]], o.words[0]
    if o.nargs and o.kind is list:  # several words
        return [o.cli_flag, "/p", "/q"], ["/p", "/q"]
    if o.nargs:  # NAME=VALUE words
        return [o.cli_flag, "a=/p", "b=/q"], {"a": "/p", "b": "/q"}
    if o.kind is dict:
        spec = {"method": "ngram", "num_speculative_tokens": 2}
        return [o.cli_flag, json.dumps(spec)], spec
    if o.kind is int:  # within the declared range, which the command line checks as the recipe does
        value = max(3, int(o.ge or 0))
        return [o.cli_flag, str(value)], value
    if o.kind is float:  # within the declared range too
        value = max(0.5, (o.gt or o.ge or 0) + 0.5)
        return [o.cli_flag, str(value)], value
    return [o.cli_flag, "x"], "x"


def test_the_recipe_schema_is_the_declaration() -> None:
    schema = ServeSection.model_fields
    assert list(schema) == [o.name for o in RECIPE_OPTIONS]
    assert ServeSection().model_dump() == {o.name: o.default for o in RECIPE_OPTIONS}
    for o in RECIPE_OPTIONS:
        assert schema[o.name].description == o.help
        bad = [o.ge - 1 if o.ge is not None else None, o.gt, o.le + 1 if o.le is not None else None,
               "evict" if o.choices else None, None if o.nullable else "null"]
        for value in [v for v in bad if v is not None] + ([None] if not o.nullable else []):
            with pytest.raises(ValidationError):
                ServeSection.model_validate({o.name: value})


def test_the_flags_are_the_declaration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One flag per option (dest its name, default None: the bundle's value), and what each flag gives reaches
    the engine as the option's value."""
    actions = {a.dest: a for a in serve_parser()._actions}
    flagged = [o for o in SERVE_OPTIONS if o.cli_flag is not None]
    for o in flagged:
        assert o.cli_flag in actions[o.name].option_strings and actions[o.name].default is None
        assert actions[o.name].help.startswith(o.help)
    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.delenv("OMFORGE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    seen: dict[str, Any] = {}
    monkeypatch.setattr("omforge.serve.server.serve", lambda bundle, options, **engine: seen.update(engine) or 0)
    assert cli.main(["serve", str(tmp_path)]) == 0 and seen == {}
    argv, want = ["serve", str(tmp_path)], {}
    for o in flagged:
        words, want[o.name] = sample(o)
        argv += words
    assert cli.main(argv) == 0 and seen == want
    # PD needs NIXL, LoRA a bundle compiled with compile.lora (tests/test_lora_serve.py)
    lora_or_pd = ("kv_transfer_config", "lora_modules", "max_loras", "max_cpu_loras", "enable_runtime_lora",
                  "lora_dirs")
    assert EngineConfig.resolve(manifest(), **{k: v for k, v in seen.items() if k not in lora_or_pd})


def test_a_flag_with_words_takes_a_number_a_word_or_none(capsys: pytest.CaptureFixture[str]) -> None:
    p = serve_parser()
    for text, value in (("32", 32), ("auto", "auto"), ("none", "none")):
        assert p.parse_args(["b", "--max-prefill-tokens-with-decodes", text]).max_prefill_tokens_with_decodes == value
    with pytest.raises(SystemExit):
        p.parse_args(["b", "--max-prefill-tokens-with-decodes", "fast"])
    assert "expected a positive number, 'auto' or 'none', got 'fast'" in capsys.readouterr().err


def test_the_engine_takes_every_option_and_a_missing_key_is_its_default() -> None:
    assert {f.name for f in fields(EngineConfig)} == {o.name for o in SERVE_OPTIONS} | set(CALLER_OPTIONS) | DERIVED
    old = replace(manifest(), serve={})  # a bundle compiled before every serve key
    cfg = EngineConfig.resolve(old)
    for o in RECIPE_OPTIONS:
        if o.default is not None:
            assert getattr(cfg, o.name) == o.default, o.name
    assert cfg.max_waiting_requests == cfg.max_num_seqs and not cfg.explicit_waiting
    assert cfg.hicache_storage_size_gb == 16.0


def test_runtime_lora_is_also_turned_on_by_vllms_kind_of_variable(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``OMFORGE_ALLOW_RUNTIME_LORA_UPDATING=1`` (or true) is ``--enable-runtime-lora`` (vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); the flag's ``--no-`` form wins over it; anything else leaves it unset."""
    (tmp_path / "manifest.json").write_text("{}")
    seen: dict[str, Any] = {}
    monkeypatch.setattr("omforge.serve.server.serve", lambda bundle, options, **engine: seen.update(engine) or 0)
    for value, argv, want in (("1", [], True), ("True", [], True), ("1", ["--no-enable-runtime-lora"], False),
                              ("0", [], None), ("yes", [], None)):
        monkeypatch.setenv("OMFORGE_ALLOW_RUNTIME_LORA_UPDATING", value)
        seen.clear()
        assert cli.main(["serve", str(tmp_path), *argv]) == 0
        assert seen.get("enable_runtime_lora") == want, (value, argv)


def test_the_lora_options_on_a_bundle_without_lora(tmp_path: Path) -> None:
    """``enable_runtime_lora`` alone (it may come from the environment) is no error on a bundle without LoRA
    slots, and resolves off; the options that configure adapters are refused there, in one line naming them."""
    assert EngineConfig.resolve(manifest(), enable_runtime_lora=True).enable_runtime_lora is False
    for name, value in (("lora_dirs", [str(tmp_path)]), ("max_cpu_loras", 4)):
        with pytest.raises(ValueError, match=f"{name}: this bundle was compiled without compile.lora"):
            EngineConfig.resolve(manifest(), **{name: value})
