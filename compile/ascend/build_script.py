"""The bundle's ``build.sh``: what it runs for each command of ``ascend/atc_commands.txt`` — ``atc`` for a gather OM,
the RefData builder (:mod:`.refdata_build`) for an in-place one — after the toolkit check and our plugins' build.
Apart from :mod:`.atc` so that the builder's module, which builds on atc's command lines, and atc's do not import
each other."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from omforge.compile.ascend import refdata_build
from omforge.compile.ascend.atc import output_prefix
from omforge.compile.ascend.render import (
    PLUGIN_VENDOR,
    SAFE_IN_DOUBLE_QUOTES,
    AtcError,
    PluginProject,
    quote,
    templates,
    write_file,
)
from omforge.contract import ascend as ascend_contract


def render_build_script(commands: Sequence[Sequence[str]], path: Path, plugins: PluginProject | None = None) -> Path:
    """Write the bundle's ``build.sh``: source CANN's set_env.sh when ``ASCEND_TOOLKIT_HOME`` is set, say in one line
    when the installed toolkit is older than :data:`~omforge.contract.ascend.CANN_RELEASE`, build and install our
    plugins into the bundle (``<plugins>/opp``, found through ``ASCEND_CUSTOM_OPP_PATH``) when there are any,
    compile the RefData builder (:mod:`.refdata_build`) when a command is its, run every command (``atc``, or the
    builder for an in-place OM) with its log in ``logs/`` and check each .om exists. It runs from its own folder:
    give the commands' paths relative to ``path.parent``."""
    if not commands:
        raise AtcError("build.sh: no atc commands to write")
    models = [{"name": output_prefix(c).name, "prefix": str(output_prefix(c)), "args": [quote(a) for a in c],
               "tool": "refdata_build" if refdata_build.is_builder(c) else "atc"} for c in commands]
    plugins_dir = os.path.relpath(plugins.dir, path.parent) if plugins is not None else None
    if plugins_dir is not None and not SAFE_IN_DOUBLE_QUOTES.fullmatch(plugins_dir):
        raise AtcError(f"build.sh: the plugin folder {plugins_dir!r} contains a character a shell string cannot hold")
    builder = any(m["tool"] == "refdata_build" for m in models)
    text = templates().get_template("build.sh.j2").render(
        models=models, plugins_dir=plugins_dir, own_kernels=plugins.own_kernels if plugins else [],
        vendor=PLUGIN_VENDOR, release=ascend_contract.CANN_RELEASE, uses_atc=any(m["tool"] == "atc" for m in models),
        builder=({"dir": refdata_build.BUILDER_DIR, "binary": refdata_build.BUILDER,
                  "source": f"{refdata_build.BUILDER_DIR}/{refdata_build.BUILDER_SOURCE}"} if builder else None))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(path, text, 0o755)
