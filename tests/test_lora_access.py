"""What a runtime adapter load may read and what an adapter may be called (runtime/lora/access.py, issue 64 item
5), on real directories, files and symlinks: a path resolving outside the operator's directories is refused however
it gets there, every refusal says the same thing to the client and the reason to the log, names are bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omforge.runtime.lora.access import NAME_MAX, PATH_REFUSED, LoraNameInvalid, LoraPathRefused, check_name, confine


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """``allowed/`` with a PEFT-looking directory ``ok`` and a ``x.gguf``, and ``allowed-evil/`` beside it (a
    directory whose name starts with the allowed one's) with a PEFT-looking directory too."""
    allowed, evil = tmp_path / "allowed", tmp_path / "allowed-evil"
    for d in (allowed / "ok", evil / "ok"):
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(b"")
    (allowed / "x.gguf").write_bytes(b"GGUF")
    (allowed / "notes.txt").write_text("no")
    return allowed, evil


def test_paths_inside_are_resolved(tree: tuple[Path, Path], tmp_path: Path) -> None:
    allowed, _ = tree
    dirs = (os.path.realpath(allowed),)
    assert confine(str(allowed / "ok"), dirs) == Path(os.path.realpath(allowed / "ok"))
    assert confine("ok", dirs) == confine(str(allowed / "ok"), dirs)  # relative: looked up in the directories
    assert confine(str(allowed / "ok" / ".." / "x.gguf"), dirs).name == "x.gguf"
    (allowed / "alias").symlink_to(allowed / "ok")  # a symlink that stays inside
    assert confine("alias", dirs) == confine("ok", dirs)
    other = tmp_path / "other"
    other.mkdir()
    assert confine("ok", (os.path.realpath(other), *dirs)).parent == Path(dirs[0])  # the first that exists


def test_every_refusal_says_the_same_and_the_reason_is_kept_for_the_log(tree: tuple[Path, Path]) -> None:
    allowed, evil = tree
    dirs = (os.path.realpath(allowed),)
    (allowed / "out").symlink_to(evil / "ok")
    peft = allowed / "peft-out"
    peft.mkdir()
    (peft / "adapter_config.json").write_text("{}")
    (peft / "adapter_model.safetensors").symlink_to(evil / "ok" / "adapter_model.safetensors")
    cases = {str(evil / "ok"): "outside", "../allowed-evil/ok": "outside", str(allowed / "out"): "outside",
             str(peft): "outside", str(allowed / "missing"): "does not exist", "/": "outside",
             str(allowed / "notes.txt"): "neither a directory nor a .gguf", "a\0b": "ValueError",
             "x" * 5000: "does not exist"}
    for path, reason in cases.items():
        with pytest.raises(LoraPathRefused) as e:
            confine(path, dirs)
        assert str(e.value) == PATH_REFUSED and reason in e.value.detail, (path, e.value.detail)
    with pytest.raises(LoraPathRefused) as e:
        confine("ok", ())
    assert "no --lora-dirs" in e.value.detail


def test_names_are_bounded_and_validated() -> None:
    for good in ("a", "sql", "org/sql-v1.2:latest", "A" * NAME_MAX):
        assert check_name(good) == good
    for bad in ("", "a b", "-a", ".a", "/a", "a\n", "é", "a" * (NAME_MAX + 1), None, 3):
        with pytest.raises(LoraNameInvalid):
            check_name(bad)
    with pytest.raises(LoraNameInvalid) as e:
        check_name("n" * 1_000_000)
    assert len(str(e.value)) < 200 and "1000000 characters" in str(e.value)
