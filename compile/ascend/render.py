"""What the ascend bundle's rendered files share: the jinja2 templates, the write helper, our plugin library's
names and the rendered plugin project, and the error the ATC step raises. Imported by :mod:`.atc` (command lines,
``build.sh``) and :mod:`.atc_plugins` (plugin sources), which do not import each other."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from omforge.errors import OmforgeError
from omforge.passes.ascend.lower import CustomOp

PLUGIN_LIBRARY = "libcust_onnx_parsers.so"
PLUGIN_VENDOR = "omforge"
SAFE_IN_DOUBLE_QUOTES = re.compile(r"[^\"$`\\!\n]*")
"""What a shell string in double quotes holds as it is."""


class AtcError(OmforgeError):
    """A model profile ATC cannot take, or an ``atc`` run that failed (the message names its log)."""


@dataclass
class PluginProject:
    """The rendered custom-op project: plugin sources, CMakeLists.txt, build.sh, README.md."""

    dir: Path
    ops: list[CustomOp]
    files: list[Path] = field(default_factory=list)

    @property
    def own_kernels(self) -> list[str]:
        """Op types whose plugin needs a kernel (and GE op prototype) we do not provide."""
        return [op.op_type for op in self.ops if op.own_kernel]


def quote(arg: str) -> str:
    """Shell-quote one argument; a ``--flag=value`` keeps the flag bare and double-quotes the value the way ATC's
    docs write it (``--input_shape="a:1,-1;b:-1"``)."""
    if not arg or shlex.quote(arg) == arg:
        return arg or "''"
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("--") and shlex.quote(flag) == flag:
        if shlex.quote(value) == value:
            return arg
        if SAFE_IN_DOUBLE_QUOTES.fullmatch(value):
            return f'{flag}="{value}"'
        return f"{flag}={shlex.quote(value)}"
    return shlex.quote(arg)


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("omforge.compile.ascend", "templates"), autoescape=False,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["cstr"] = json.dumps  # a JSON string literal is a valid C++ one for these ASCII names
    env.filters["shell"] = quote
    return env


def write_file(path: Path, text: str, mode: int = 0o644) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path
