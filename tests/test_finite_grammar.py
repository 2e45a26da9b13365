"""A grammar that matches no finite text (issue 64 item 7): ``start: "a" start`` compiles in llguidance, and the
constrained output then ran to ``max_tokens`` — now a 400 naming the field, as an unsatisfiable regex is
(runtime/finite_grammar.py reads the rules; anything it does not understand gets no verdict, never a 400)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from omforge.runtime.finite_grammar import unending_rules
from omforge.runtime.structured import StructuredOutput, StructuredOutputError, grammar
from server_process import ServerProcess


@pytest.mark.parametrize(("lark", "unending"), [
    ('start: "a" start', ["start"]),
    ('start: a\na: "x" a | "y" a', ["start", "a"]),
    ('start: x\nx: x "a"', ["start", "x"]),  # left recursion without a base (llguidance also refuses this one)
    ('start: "a" start ~ 1..2', ["start"]),
    ('start: "a".."z" start', ["start"]),
    ('start: "a" start | "b"', []),
    ('start: "a" start?', []),
    ('start: "a" [start]', []),
    ('start: ("a" start)*', []),
    ('start: "a" start ~ 0..2', []),
    ('start: a\na: "x"\n  | "y"', []),
    ('start: A\nA: "x"\n  | "y"', []),
    ('start: x\n%ignore " "\nx: "q"', []),
    ('start: <|im_end|> "x" %json{"type": "object", "a": "}"}', []),
    ('?start: a -> b\na: "x"', []),
    ('start: "The answer is " ("red" | "green" | "blue") "."', []),
    ('start: x\nx[lazy]: /.*/ "end"', []),
    ('start: value\nvalue: object | STRING\nobject: "{" [pair ("," pair)*] "}"\npair: STRING ":" value\n'
     '%import common.ESCAPED_STRING -> STRING', []),
    ('start: %lark { x }', None),  # a nested grammar: not read here, no verdict
])
def test_unending_rules(lark: str, unending: list[str] | None) -> None:
    assert unending_rules(lark) == unending


def test_the_grammar_is_refused_naming_the_field() -> None:
    with pytest.raises(StructuredOutputError) as info:
        grammar(StructuredOutput("grammar", 'start: "a" start', "structured_outputs.grammar"))
    assert info.value.param == "structured_outputs.grammar" and "no finite text" in str(info.value)
    assert grammar(StructuredOutput("grammar", 'start: "a" start | "b"')) == 'start: "a" start | "b"'


def test_the_server_answers_400(smollm2_bundle: Path) -> None:
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "16", "--max-num-seqs", "1", "--threads", "1")
    try:
        for body in ({"structured_outputs": {"grammar": 'start: "a" start'}}, {"guided_grammar": 'start: "a" start'}):
            r = httpx.post(srv.base_url + "/completions", json={"prompt": "Say a:", "max_tokens": 8, **body},
                           timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == next(iter(body)) + (".grammar" if "structured" in str(body) else "")
            assert "no finite text" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log()
