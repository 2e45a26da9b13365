"""Whether a Lark grammar (llguidance's dialect) matches any finite text: a rule whose every alternative needs a
rule that never ends (``start: "a" start``) compiles, and the constrained output then runs to ``max_tokens``.

Contract: :func:`unending_rules` reads the grammar's rules (lowercase names; tokens — uppercase names, strings,
regexes, special tokens, ``%json`` / ``%regex`` — are regular, so each matches finite text, and llguidance refuses
a recursive token itself) and returns the rules that derive no finite text, ``start`` first when it is one of
them. It never refuses a grammar it does not understand: any construct outside the subset read here gives None
(no verdict), so a caller refuses only what is certainly unending.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r]+|//[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<directive>%[a-z_]+)
  | (?P<ref>@[A-Za-z0-9_]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>[0-9]+)
  | (?P<punct>\.\.|->|[:|()\[\]{}~*+?!.,=&-])
""", re.VERBOSE)
_BLOCK_DIRECTIVES = ("%json", "%regex", "%llguidance")  # each followed by a {...} block of JSON


class _Unknown(Exception):
    """A construct this reader does not handle: no verdict."""


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str


def _tokens(text: str) -> list[_Tok]:
    """The grammar's tokens (``%json {...}``-style blocks as one ``block`` token), newlines kept."""
    out: list[_Tok] = []
    at = 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            raise _Unknown(f"character {text[at]!r}")
        kind, word = m.lastgroup or "", m.group()
        at = m.end()
        if kind == "directive" and word in _BLOCK_DIRECTIVES:
            at = _skip_block(text, at)
            out.append(_Tok("block", word))
        elif kind != "ws":
            out.append(_Tok(kind, word))
    return out


def _skip_block(text: str, at: int) -> int:
    """The index after the ``{...}`` block (JSON: strings may hold braces) that starts at ``at`` past spaces."""
    while at < len(text) and text[at] in " \t":
        at += 1
    if at >= len(text) or text[at] != "{":
        raise _Unknown("a directive without its {...} block")
    depth, in_string, escaped = 0, False, False
    for i in range(at, len(text)):
        c = text[i]
        if in_string:
            in_string = not (c == '"' and not escaped)
            escaped = c == "\\" and not escaped
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise _Unknown("an unclosed {...} block")


# an expression: ("lit",) always ends; ("ref", name); ("seq", [exprs]) needs all; ("alt", [exprs]) needs one
Expr = tuple


class _Parser:
    """Recursive descent over one definition's tokens (no newlines inside: llguidance allows none there)."""

    def __init__(self, toks: list[_Tok]):
        self.toks, self.at = toks, 0

    def peek(self) -> _Tok | None:
        return self.toks[self.at] if self.at < len(self.toks) else None

    def take(self, text: str | None = None) -> _Tok:
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text):
            raise _Unknown(f"expected {text or 'more'}")
        self.at += 1
        return tok

    def expansions(self) -> Expr:
        alts = [self.alternative()]
        while (tok := self.peek()) is not None and tok.text == "|":
            self.take()
            alts.append(self.alternative())
        return ("alt", alts)

    def alternative(self) -> Expr:
        items = []
        while (tok := self.peek()) is not None and tok.text not in ("|", ")", "]", "->"):
            items.append(self.item())
        if (tok := self.peek()) is not None and tok.text == "->":  # an alias names the tree node only
            self.take()
            if self.take().kind != "name":
                raise _Unknown("an alias without a name")
        return ("seq", items)

    def item(self) -> Expr:
        atom = self.atom()
        tok = self.peek()
        if tok is None:
            return atom
        if tok.text in ("?", "*"):
            self.take()
            return ("lit",)
        if tok.text == "+":
            self.take()
            return atom
        if tok.text == "~":
            self.take()
            least = self.take()
            if least.kind != "number":
                raise _Unknown("a repetition without its count")
            if (dots := self.peek()) is not None and dots.text == "..":
                self.take()
                if self.take().kind != "number":
                    raise _Unknown("a repetition range without its end")
            return ("lit",) if int(least.text) == 0 else atom
        return atom

    def atom(self) -> Expr:
        tok = self.take()
        if tok.kind == "string":
            if (dots := self.peek()) is not None and dots.text == "..":  # a character range "a".."z"
                self.take()
                if self.take().kind != "string":
                    raise _Unknown("a range without its end")
            return ("lit",)
        if tok.kind in ("regex", "special", "block", "ref"):
            return ("lit",)
        if tok.kind == "name":
            return ("ref", tok.text) if _is_rule(tok.text) else ("lit",)
        if tok.text == "(":
            inner = self.expansions()
            self.take(")")
            return inner
        if tok.text == "[":
            self.expansions()
            self.take("]")
            return ("lit",)
        raise _Unknown(f"unexpected {tok.text!r}")


def _is_rule(name: str) -> bool:
    """Lark's convention: rules are lowercase (``_``-prefixed allowed), tokens uppercase."""
    return name.lstrip("_")[:1].islower()


def _definitions(toks: list[_Tok]) -> dict[str, list[_Tok]]:
    """Each rule's expansion tokens (its header line and the ``|`` lines that continue it); directives and token
    definitions are skipped."""
    lines: list[list[_Tok]] = [[]]
    for tok in toks:
        if tok.kind == "nl":
            lines.append([])
        else:
            lines[-1].append(tok)
    rules: dict[str, list[_Tok]] = {}
    current: list[_Tok] | None = None  # the definition a '|' line continues (a token's: a list kept nowhere)
    for line in filter(None, lines):
        if line[0].text == "|":
            if current is None:
                raise _Unknown("a '|' line outside a definition")
            current.extend(line)
            continue
        current = None
        if line[0].kind in ("directive", "block"):
            if line[0].text not in ("%ignore", "%import", "%declare", "%llguidance"):
                raise _Unknown(f"directive {line[0].text}")
            continue
        name, body = _header(line)
        if name in rules:
            raise _Unknown(f"rule {name} defined twice")
        current = body
        if _is_rule(name):
            rules[name] = body
    return rules


def _header(line: list[_Tok]) -> tuple[str, list[_Tok]]:
    """``[?!]name[attrs][.priority]:`` → the name and the tokens after the colon."""
    at = 0
    while at < len(line) and line[at].text in ("?", "!"):
        at += 1
    if at >= len(line) or line[at].kind != "name":
        raise _Unknown("a line that starts no definition")
    name = line[at].text
    at += 1
    if at < len(line) and line[at].text == "[":  # attributes: [lazy], [max_tokens=5], [stop="..."], …
        while at < len(line) and line[at].text != "]":
            at += 1
        at += 1
    if at < len(line) and line[at].text == ".":  # a priority
        at += 2 if at + 1 < len(line) and line[at + 1].kind == "number" else 1
        if at < len(line) and line[at].kind == "number":
            at += 1
    if at >= len(line) or line[at].text != ":":
        raise _Unknown(f"definition of {name} without ':'")
    return name, line[at + 1:]


def _ends(expr: Expr, finite: set[str], rules: dict[str, Expr]) -> bool:
    kind = expr[0]
    if kind == "lit":
        return True
    if kind == "ref":
        return expr[1] in finite or expr[1] not in rules  # an undefined name: llguidance's own error, not ours
    if kind == "seq":
        return all(_ends(e, finite, rules) for e in expr[1])
    return any(_ends(e, finite, rules) for e in expr[1])


def unending_rules(lark: str) -> list[str] | None:
    """The rules of ``lark`` that derive no finite text (``start`` first when it is one), [] when every rule
    ends, None when the grammar holds something this reader does not handle (no verdict)."""
    try:
        parsed = {}
        for name, body in _definitions(_tokens(lark)).items():
            parser = _Parser(body)
            parsed[name] = parser.expansions()
            if parser.peek() is not None:
                raise _Unknown(f"rule {name}: unexpected {parser.peek().text!r}")  # type: ignore[union-attr]
    except _Unknown:
        return None
    finite: set[str] = set()
    changed = True
    while changed:  # the least fixed point: a rule ends once one alternative needs only rules that end
        changed = False
        for name, expr in parsed.items():
            if name not in finite and _ends(expr, finite, parsed):
                finite.add(name)
                changed = True
    return sorted((n for n in parsed if n not in finite), key=lambda n: (n != "start", n))
