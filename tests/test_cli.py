"""The ``omforge`` command line: subcommands, export and generate end to end, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import hf_reference, make_tiny_hf_dir, write_recipe
from omforge.cli import main


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omforge", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    hf_dir = make_tiny_hf_dir(root / "hf", "llama")
    return hf_dir, write_recipe(root / "tiny.yaml", {"name": "tiny", "source": "hf", "path": "hf"})


def test_help_lists_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for sub in ("export", "generate"):
        assert sub in out.stdout


def test_export_then_generate_matches_transformers(tiny: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    hf_dir, recipe = tiny
    assert main(["export", str(recipe), "-o", str(tmp_path / "exp")]) == 0
    assert "exported tiny" in capsys.readouterr().out
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "the quick brown fox", "--max-tokens", "12",
                 "--ignore-eos", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 12 and result["finish_reason"] == "length"
    from tokenizers import Tokenizer

    prompt_ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode("the quick brown fox").ids
    assert result["prompt_tokens"] == len(prompt_ids)
    with torch.no_grad():
        ref = hf_reference(hf_dir).generate(torch.tensor([prompt_ids]), max_new_tokens=12, min_new_tokens=12,
                                            do_sample=False, pad_token_id=0)
    assert result["token_ids"] == ref[0, len(prompt_ids):].tolist()


def test_generate_from_recipe_exports_once(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    _, recipe = tiny
    env = {**__import__("os").environ, "OMFORGE_CACHE_DIR": str(tmp_path / "cache")}
    first = run_cli("generate", str(recipe), "--prompt", "hello world", "--max-tokens", "4", "--json", env=env)
    assert first.returncode == 0, first.stderr
    assert "[export] torch.onnx.export" in first.stderr
    second = run_cli("generate", str(recipe), "--prompt", "hello world", "--max-tokens", "4", "--json", env=env)
    assert second.returncode == 0 and "[export]" not in second.stderr  # reused the cached export
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]
    assert len(list((tmp_path / "cache" / "exports").glob("*/export.json"))) == 1


@pytest.mark.parametrize("args, message", [
    (["generate", "/nonexistent/export", "--prompt", "x"], "/nonexistent/export: no such recipe or export directory"),
    (["generate", "pyproject.toml", "--prompt", "x"],
     "pyproject.toml: expected a recipe (.yaml) or an export directory"),
    (["generate", "tests/recipes/tiny-llama.yaml", "--prompt", "x", "--max-tokens", "0"],
     "--max-tokens must be at least 1"),
])
def test_bad_generate_arguments(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "omforge", *args], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"omforge: error: {message}"]


def test_overlong_prompt_is_rejected(tiny: tuple[Path, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _, recipe = tiny
    assert main(["export", str(recipe), "-o", str(tmp_path / "exp")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "fox " * 300, "--max-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("omforge: error: prompt (") and "exceeds the model's context of 512 tokens" in err


def test_model_without_tokenizer_cannot_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = Path(__file__).resolve().parent / "recipes" / "tiny-llama.yaml"
    assert main(["export", str(recipe), "-o", str(tmp_path / "exp")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "exp"), "--prompt", "hi"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
