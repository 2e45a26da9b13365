"""What a LoRA adapter may be called, and where a load at run time may read one from (docs/lora.md, "Runtime
loading"): :func:`check_name` (every adapter registered) and :func:`confine` (``POST /v1/load_lora_adapter``).

Invariants: a registered name is 1 … :data:`NAME_MAX` characters of :data:`NAME_RULE`; a path :func:`confine`
returns is a real path (no symlink, no ``..``) inside one of the operator's directories, and so are the PEFT files
in it. A refused path's message is the same whatever the reason (missing, outside, unreadable, not an adapter):
the reason is :attr:`LoraPathRefused.detail`, for the server's log only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from omforge.runtime.lora.base import LoraError
from omforge.runtime.lora.peft import CONFIG_FILE, WEIGHTS_FILE

NAME_MAX = 64
NAME_RULE = f"1 … {NAME_MAX} characters of letters, digits and . _ - : /, starting with a letter or digit"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
PATH_REFUSED = ("lora_path: no LoRA adapter this server may load there (a PEFT adapter directory or a .gguf LoRA "
                "file inside one of the server's --lora-dirs; the server's log says why)")


class LoraNameInvalid(LoraError):
    """An adapter name that is empty, too long or outside :data:`NAME_RULE` (the message never repeats a long
    name)."""


class LoraPathRefused(LoraError):
    """A ``lora_path`` a runtime load may not read: :data:`PATH_REFUSED` for the client, ``detail`` for the log."""

    def __init__(self, detail: str):
        super().__init__(PATH_REFUSED)
        self.detail = detail


def check_name(name: object) -> str:
    """``name`` if it is a valid adapter name, else :class:`LoraNameInvalid` (one line, the rule)."""
    if not isinstance(name, str) or not name:
        raise LoraNameInvalid(f"lora_name: the adapter needs a name ({NAME_RULE})")
    if len(name) > NAME_MAX:
        raise LoraNameInvalid(f"lora_name: {len(name)} characters; an adapter name is {NAME_RULE}")
    if not _NAME.fullmatch(name):
        raise LoraNameInvalid(f"lora_name: {name!r} is not an adapter name ({NAME_RULE})")
    return name


def _inside(path: str, dirs: Sequence[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def confine(lora_path: str, dirs: Sequence[str]) -> Path:
    """The adapter ``lora_path`` names, as a real path inside one of ``dirs`` (real paths of directories): an
    absolute path as it resolves, a relative one joined to each directory in turn (the first that exists). It must
    be a directory whose PEFT files also resolve inside, or a ``.gguf`` file. :class:`LoraPathRefused` otherwise."""
    if not dirs:
        raise LoraPathRefused("no --lora-dirs: runtime loads may read nothing")
    try:
        candidates = [lora_path] if os.path.isabs(lora_path) else [os.path.join(d, lora_path) for d in dirs]
        real = [os.path.realpath(c) for c in candidates]
        found = next((r for r in real if os.path.exists(r)), None)
        if found is None:
            raise LoraPathRefused(f"{lora_path!r} does not exist (looked for {', '.join(candidates)})")
        if not _inside(found, dirs):
            raise LoraPathRefused(f"{lora_path!r} resolves to {found}, outside --lora-dirs {', '.join(dirs)}")
        if os.path.isdir(found):
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                inner = os.path.realpath(os.path.join(found, name))
                if os.path.lexists(os.path.join(found, name)) and not _inside(inner, dirs):
                    raise LoraPathRefused(f"{lora_path!r}: {name} resolves to {inner}, outside --lora-dirs")
        elif not (os.path.isfile(found) and found.lower().endswith(".gguf")):
            raise LoraPathRefused(f"{lora_path!r} ({found}) is neither a directory nor a .gguf file")
    except LoraPathRefused:
        raise
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the file system …
        raise LoraPathRefused(f"{lora_path[:200]!r}: {type(exc).__name__}: {exc}") from None
    return Path(found)
