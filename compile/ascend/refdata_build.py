"""How an in-place step OM gets its KV pools as ``RefData`` inputs: a small C++ builder over CANN's public IR build
API, rendered into the bundle (``ascend/refdata_build/``) and run by ``build.sh`` where ``atc`` runs for a gather
bundle. Nothing here has been compiled against a CANN toolkit or run on an NPU.

**Why not ``atc --framework=5``.** ATC's ONNX parser turns every graph input into a plain ``Data`` node (hicann/ge
``parser/parser/onnx/onnx_parser.cc:175-177, 293-357``, ffdcbc9), and GE protects a ``Data`` written by a ref op with
a copy (``compiler/graph/passes/feature/inner_identity_add_pass.cc:30-60, 95-104``): the write is lost. Only a
var-like input (``Variable``, ``VariableV2``, ``RefData``: ``graph_metadef/graph/utils/op_type_utils.cc:91-93``)
skips the copy, and at run time a ``RefData`` input is always the caller's buffer
(``runtime/v1/graph/load/model_manager/davinci_model.cc:2190-2200``).

**Decision: (a) the IR build API**, over (b) parse → ``.air`` → flip the op type in the ``ge_ir.proto`` ModelDef →
``atc --framework=1``:

- (a) uses only public, documented calls, each in an installed header: ``aclgrphParseONNX``
  (``inc/parser/external/parser/onnx_parser.h:34``), ``Graph::FindNodeByName`` / ``RemoveNode`` / ``AddNodeByOp`` /
  ``AddDataEdge`` (``inc/graph_metadef/external/graph/graph.h:152-171``), ``OperatorFactory::CreateOperator`` (the
  way the ONNX parser itself creates its ops, ``onnx_parser.cc:466``), ``aclgrphBuildInitialize`` /
  ``aclgrphBuildModel`` / ``aclgrphSaveModel`` (``inc/external/ge/ge_ir_build.h:68-110``). The gear options are the
  IR options atc maps its flags to (``ir_option`` in ``inc/graph_metadef/external/ge_common/ge_common_api_types.h:
  614-683``; build options ``ir_builder_suppported_options`` :699-753 hold INPUT_FORMAT, INPUT_SHAPE, DYNAMIC_DIMS,
  PRECISION_MODE, LOG_LEVEL, TILING_SCHEDULE_OPTIMIZE; ``SOC_VERSION`` is a global option of
  ``aclgrphBuildInitialize``, :761-803). The IR build treats ``RefData`` as a data node and orders the model's inputs
  by their ``index`` attribute (``compiler/api/aclgrph/ge_ir_build.cc:998-1051``; ``OpTypeUtils::IsDataNode``,
  ``op_type_utils.cc:19, 71-73``), so keeping each Data's index keeps the ONNX input order the executor binds.
  Linking follows CANN's own sample (``examples/offline_compile_run/cpp/CMakeLists.txt:8-33``:
  ``_GLIBCXX_USE_CXX11_ABI=0``, ``-lge_compiler``; ``libfmk_onnx_parser.so`` for ``parser/onnx_parser.h``, ``libgraph``
  / ``libgraph_base`` for the graph API: ``docs/zh/api/graph_engine_api/header_and_library_files_description.md``).
- (b) needs the ``ge_ir.proto`` schema and a protobuf round trip of a ModelDef we never see (the parse would still
  be C++ or Python bindings of CANN), plus a 2 GB protobuf limit on the ``.air`` (weights must stay external), and
  renumbers nothing for us. torchair does the flip on its own GE graph (``replace_data_to_refdata``,
  ``python/torchair/_ge_concrete_graph/graph_pass.py:283-308``, fced884) before writing the ``.air``; we start from
  ONNX, so (a) does the same flip one step earlier, in memory.

The builder takes atc's own flags (minus ``--framework``, plus ``--ref_inputs`` and, where CANN allows it,
``--tiling_schedule_optimize=1``), so :mod:`.atc_conformance` checks its argv with atc's rules and the FAKE
(tests/fake_atc.py) reads the same line from ``ascend/atc_commands.txt``.

Tiling sink ("Tiling下沉": FIA / IFA tiling computed on the device) is on where CANN documents it: Atlas A2/A3
(910B, 910_93) and Atlas inference (310P), not 310B (Atlas 200I/500 A2) nor the Atlas training series (910), and only
for static shapes — each gear of ``--dynamic_dims`` is one (``docs/zh/user_guides/atc_tools/CLI_options/
--tiling_schedule_optimize.md:3-42``).

[unverified] whether a RefData survives the gear clone (``--dynamic_dims`` makes a Case of gear subgraphs) as the
same user buffer; whether ``RemoveNode`` + ``AddNodeByOp`` on a parsed graph keeps the graph's input list
consistent for the build (``ComputeGraph::RemoveInputNode`` drops the old node, ``AddNode`` does not register the
new one as an input; the IR build finds data nodes by type, ``ge_ir_build.cc:998-1009``); the include and library
layout of a given toolkit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omforge.compile.ascend.atc import AtcModelSpec, atc_command
from omforge.compile.ascend.render import AtcError, templates, write_file
from omforge.contract.ascend import CANN_RELEASE
from omforge.recipe import CompileSection

BUILDER_DIR = "refdata_build"
"""The builder's folder inside ``ascend/``: its C++ source, and the binary ``build.sh`` compiles there."""
BUILDER_SOURCE = "omforge_refdata_build.cc"
BUILDER = f"./{BUILDER_DIR}/omforge_refdata_build"
"""``argv[0]`` of the builder command, relative to ``ascend/`` (where ``build.sh`` runs)."""
REF_INPUTS_FLAG = "--ref_inputs"
TILING_FLAG = "--tiling_schedule_optimize"
TILING_SINK_FAMILIES = ("ascend910b", "ascend910_93", "ascend310p")
"""SoC families whose tiling sink CANN documents as supported (--tiling_schedule_optimize.md:3-27: 950, A3, A2 and
Atlas inference 310P yes; 310B and the Atlas training series 910 no)."""


def tiling_sink_allowed(soc_version: str) -> bool:
    """Whether ``--tiling_schedule_optimize=1`` is documented for ``soc_version``'s family."""
    from omforge.passes.ascend.kernels import soc_family

    return soc_family(soc_version) in TILING_SINK_FAMILIES


def is_builder(argv: Sequence[str]) -> bool:
    """Whether a bundle command is the RefData builder's (else it is ``atc``'s)."""
    return bool(argv) and argv[0] == BUILDER


def refdata_command(spec: AtcModelSpec, compile: CompileSection, out_dir: Path, ref_inputs: Sequence[str]) -> list[str]:
    """The builder's exact argv for ``spec``: atc's gear command (:func:`.atc.atc_command`, same flags and values)
    without ``--framework``, with the inputs to flip and, where CANN documents it for the SoC, tiling sink (every
    gear is a static shape). Raises :class:`AtcError` for no ref inputs, a repeated one, or one that is a gear input
    (``--input_shape`` lists it: a pool is static in the graph)."""
    if not ref_inputs:
        raise AtcError(f"ATC model '{spec.name}': the RefData builder needs at least one ref input")
    if len(set(ref_inputs)) != len(ref_inputs):
        raise AtcError(f"ATC model '{spec.name}': repeated ref inputs in {list(ref_inputs)}")
    dynamic = sorted(set(ref_inputs) & set(spec.input_shapes))
    if dynamic:
        raise AtcError(f"ATC model '{spec.name}': ref input(s) {dynamic} have a gear dim; an in-place pool is static")
    bad = [n for n in ref_inputs if "," in n or "=" in n]
    if bad:
        raise AtcError(f"ATC model '{spec.name}': ref input name(s) {bad} contain ',' or '=' (the builder's syntax)")
    argv = [BUILDER] + [a for a in atc_command(spec, compile, out_dir)[1:] if not a.startswith("--framework=")]
    argv.append(f"{REF_INPUTS_FLAG}={','.join(ref_inputs)}")
    if tiling_sink_allowed(compile.soc_version):
        argv.append(f"{TILING_FLAG}=1")
    return argv


def render_builder(asc: Path) -> list[Path]:
    """Write the builder's C++ source into ``asc/refdata_build/``; returns the files written. ``build.sh`` compiles
    it against the installed toolkit (see the template's header)."""
    folder = asc / BUILDER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    text = templates().get_template("refdata_build.cc.j2").render(release=CANN_RELEASE)
    return [write_file(folder / BUILDER_SOURCE, text)]
