"""The command line a person meets (issue 64 item 8): no parser takes an abbreviation of a long option
(``--max-num-seq 8`` is an error, not ``--max-num-seqs``), and ``omforge serve --help`` lists its flags in groups
(contract/serve_options.py ``SERVE_GROUPS``), every flag in exactly one — a serve option in the group it declares."""

from __future__ import annotations

import argparse
import re

import pytest

from omforge import cli
from omforge.contract.serve_options import SERVE_GROUPS, SERVE_OPTIONS


def subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = cli.build_parser()._subparsers._group_actions[0]
    return dict(sub.choices)


@pytest.mark.parametrize("argv, wrong", [
    (["serve", "bundle", "--max-num-seq", "8"], "--max-num-seq"),
    (["serve", "bundle", "--enable-runtime", "--lora-dirs", "/tmp"], "--enable-runtime"),
    (["compile", "recipe.yaml", "--outp", "x"], "--outp"),
    (["generate", "bundle", "--prompt", "hi", "--max-tok", "4"], "--max-tok"),
    (["inspect", "bundle", "--no-ver"], "--no-ver"),
])
def test_an_abbreviated_flag_is_an_error(argv: list[str], wrong: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert f"unrecognized arguments: {wrong}" in capsys.readouterr().err


def test_no_parser_allows_abbreviations() -> None:
    assert cli.build_parser().allow_abbrev is False
    for name, parser in subparsers().items():
        assert parser.allow_abbrev is False, name


def _sections(text: str) -> dict[str, str]:
    """``--help``'s text split at its section headings (``title:`` at the start of a line)."""
    parts = re.split(r"^(\S[^\n]*):\n", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_serve_help_is_grouped_and_every_flag_is_in_exactly_one_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    sections = _sections(capsys.readouterr().out)
    titles = [title for title, _ in SERVE_GROUPS]
    assert [t for t in sections if t in titles] == titles  # every group, in the declared order
    serve = subparsers()["serve"]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert len(flags) > 35
    declared = {o.cli_flag: o.group for o in SERVE_OPTIONS if o.cli_flag is not None}
    for flag in flags:
        where = [t for t, body in sections.items() if re.search(rf"^  (\S+, )?{re.escape(flag)}\b", body, re.M)]
        assert len(where) == 1 and where[0] in titles, (flag, where)
        if flag in declared:
            assert where[0] == declared[flag], flag
    for title, body in sections.items():  # no flag is left in argparse's catch-all section
        if title == "options":
            assert re.findall(r"^  (-\S+)", body, re.M) == ["-h,"], body
