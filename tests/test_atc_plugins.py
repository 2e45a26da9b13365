"""Our ONNX parser plugins for ATC (omforge.compile.ascend.atc_plugins): the rendered project, its agreement with the
lowering, the sources compiled with g++ against the STUB CANN headers in tests/stubs/ (and run through a harness
where a real nlohmann/json.hpp exists), and the plugins a real lowering of the tiny model needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import lowering_dict
from omforge.compile.ascend import atc_plugins
from omforge.compile.ascend.atc import AtcError

TESTS = Path(__file__).resolve().parent
STUBS = TESTS / "stubs"
GXX = shutil.which("g++")
REAL_JSON = next((d for d in (Path("/usr/include"), Path("/usr/local/include"))
                  if (d / "nlohmann" / "json.hpp").is_file()), None)
FAILED = 0xFFFFFFFF  # domi::FAILED


# --- plugins ----------------------------------------------------------------------------------------------------


def test_plugin_project_files(tmp_path: Path) -> None:
    project = atc_plugins.render_plugins(lowering_dict(), tmp_path / "plugins")
    assert project is not None
    names = sorted(p.name for p in project.files)
    assert names == ["CMakeLists.txt", "README.md", "build.sh", "npu_prompt_flash_attention_onnx_plugin.cc",
                     "om_add_rms_norm_onnx_plugin.cc", "om_fused_infer_attention_score_onnx_plugin.cc",
                     "om_rms_norm_onnx_plugin.cc",
                     "om_rotary_position_embedding_onnx_plugin.cc", "om_scatter_pa_kv_cache_onnx_plugin.cc",
                     "omforge_onnx_attrs.h", "swi_glu_onnx_plugin.cc"]
    assert project.own_kernels == []
    rms = (tmp_path / "plugins" / "om_rms_norm_onnx_plugin.cc").read_text()
    assert 'REGISTER_CUSTOM_OP("RmsNorm")' in rms
    assert '.OriginOpType({ge::AscendString("ai.onnx::18::OmRmsNorm")})' in rms
    assert ".ParseParamsByOperatorFn(ParseOmRmsNorm)" in rms and ".ImplyType(ImplyType::TVM);" in rms
    assert 'op_dest.SetAttr("epsilon", epsilon);' in rms and "[unverified]" in rms
    fia = (tmp_path / "plugins" / "om_fused_infer_attention_score_onnx_plugin.cc").read_text()
    assert 'REGISTER_CUSTOM_OP("FusedInferAttentionScore")' in fia and "[unverified]" in fia
    for attr in ("num_heads", "num_key_value_heads", "scale", "sparse_mode", "block_size", "inner_precise"):
        assert f'op_dest.SetAttr("{attr}", {attr});' in fia
    spkc = (tmp_path / "plugins" / "om_scatter_pa_kv_cache_onnx_plugin.cc").read_text()
    assert 'REGISTER_CUSTOM_OP("ScatterPaKvCache")' in spkc and "cache_mode" in spkc
    cmake = (tmp_path / "plugins" / "CMakeLists.txt").read_text()
    assert all(f"  {p.name}\n" in cmake for p in project.files if p.suffix == ".cc")
    build = tmp_path / "plugins" / "build.sh"
    assert os.access(build, os.X_OK)
    subprocess.run(["bash", "-n", str(build)], check=True)
    # without a toolkit the plugin build says what it needs instead of failing somewhere inside cmake
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_TOOLKIT_HOME"}
    run = subprocess.run(["bash", str(build)], env=env, capture_output=True, text=True, check=False)
    assert run.returncode != 0 and "set ASCEND_TOOLKIT_HOME" in run.stderr
    # the project lands in a bundle: it cites public sources, never a file outside it (issue 12)
    for f in project.files:
        text = f.read_text()
        assert "reference/" not in text and "../shared" not in text, f.name


def test_no_plugin_project_when_cann_covers_every_op(tmp_path: Path) -> None:
    lowering = lowering_dict(opset=16)  # CANN registers PFA at 16; rotary at 11..18
    lowering["custom_ops"] = {k: v for k, v in lowering["custom_ops"].items()
                              if k in ("NPUPromptFlashAttention", "NPURotaryPositionEmbedding")}
    assert atc_plugins.render_plugins(lowering, tmp_path / "plugins") is None
    assert not (tmp_path / "plugins").exists()


def test_plugin_and_lowering_must_agree(tmp_path: Path) -> None:
    lowering = lowering_dict()
    lowering["custom_ops"]["SwiGlu"]["attributes"]["axis"] = [1]
    with pytest.raises(AtcError, match="'SwiGlu' nodes carry attribute 'axis', which its plugin does not copy"):
        atc_plugins.render_plugins(lowering, tmp_path / "a")
    lowering = lowering_dict()
    lowering["custom_ops"]["OmRmsNorm"]["attributes"]["epsilon"] = ["1e-5"]
    with pytest.raises(AtcError, match="'OmRmsNorm' attribute 'epsilon'.* are not float"):
        atc_plugins.render_plugins(lowering, tmp_path / "b")
    lowering = lowering_dict()
    lowering["custom_ops"]["Mystery"] = {**lowering["custom_ops"]["SwiGlu"], "op_type": "Mystery"}
    with pytest.raises(AtcError, match="no plugin template for it"):
        atc_plugins.render_plugins(lowering, tmp_path / "c")


def gxx(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([GXX or "g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", *map(str, args)],
                          capture_output=True, text=True, check=False)


@pytest.mark.skipif(GXX is None, reason="g++ is not installed: cannot syntax-check the generated plugin sources")
def test_plugin_sources_compile_against_stub_headers(tmp_path: Path) -> None:
    project = atc_plugins.render_plugins(lowering_dict(), tmp_path / "plugins")
    assert project is not None
    sources = [p for p in project.files if p.suffix == ".cc"]
    # STUB headers (tests/stubs) declare CANN's signatures; json_stub declares nlohmann::json's few calls
    result = gxx("-fsyntax-only", "-I", STUBS, "-I", STUBS / "json_stub", "-I", project.dir, *sources)
    assert result.returncode == 0, result.stderr


def pb2json(**attrs: object) -> str:
    """The "attribute" JSON ATC's parser hands a ParseParamsByOperatorFn plugin (Pb2Json: a float as a "%g"
    string, an int as a number, a string as itself; the AttributeProto type as its enum number)."""
    items = []
    for name, value in attrs.items():
        if isinstance(value, float):
            items.append({"name": name, "f": f"{value:g}", "type": 1})
        elif isinstance(value, int):
            items.append({"name": name, "i": value, "type": 2})
        else:
            items.append({"name": name, "s": value, "type": 3})
    return json.dumps({"attribute": items}, indent=2)


@pytest.mark.skipif(GXX is None or REAL_JSON is None,
                    reason="needs g++ and a real nlohmann/json.hpp (e.g. apt nlohmann-json3-dev) to run the parse "
                           "functions through the stub-header harness")
def test_plugin_parse_functions_copy_the_onnx_attributes(tmp_path: Path) -> None:
    project = atc_plugins.render_plugins(lowering_dict(), tmp_path / "plugins")
    assert project is not None
    unity = tmp_path / "unity.h"
    unity.write_text("".join(f'#include "{p}"\n' for p in project.files if p.suffix == ".cc"))
    harness = tmp_path / "harness"
    built = gxx("-I", STUBS, "-I", project.dir, f"-DOMFORGE_PLUGINS_UNITY=\"{unity}\"", STUBS / "plugin_harness.cc",
                "-o", harness)
    assert built.returncode == 0, built.stderr

    def parse(key: str, attribute_json: str) -> tuple[int, dict[str, str], str]:
        run = subprocess.run([str(harness), key, attribute_json], capture_output=True, text=True, check=True)
        lines = [ln.split(" ", 2) for ln in run.stdout.splitlines()]
        head = {ln[0]: ln[1] for ln in lines if len(ln) == 2}
        assert head["onnx"] == "1" and head["tvm"] == "1"
        return int(head["status"]), {ln[1]: f"{ln[0]} {ln[2]}" for ln in lines if len(ln) == 3}, run.stderr

    status, attrs, _ = parse("ai.onnx::18::OmRmsNorm", pb2json(epsilon=1e-5))
    assert status == 0 and attrs == {"epsilon": "float 9.99999975e-06"}
    status, attrs, _ = parse("ai.onnx::18::OmAddRmsNorm", json.dumps({"attribute": [{"name": "epsilon", "f": 1e-6}]}))
    assert status == 0 and attrs == {"epsilon": "float 9.99999997e-07"}  # a number (not "%g" text) is taken too
    status, attrs, _ = parse("ai.onnx::18::SwiGlu", pb2json(dim=-1))
    assert status == 0 and attrs == {"dim": "int -1"}
    status, attrs, _ = parse("ai.onnx::18::OmFusedInferAttentionScore",
                             pb2json(num_heads=9, num_key_value_heads=3, scale=0.125, input_layout="BSH",
                                     sparse_mode=3, block_size=128, inner_precise=0))
    assert status == 0 and attrs == {"num_heads": "int 9", "num_key_value_heads": "int 3", "scale": "float 0.125",
                                     "input_layout": "string BSH", "sparse_mode": "int 3", "block_size": "int 128",
                                     "inner_precise": "int 0"}
    status, attrs, _ = parse("ai.onnx::18::OmScatterPaKvCache", pb2json(cache_mode="Norm"))
    assert status == 0 and attrs == {"cache_mode": "string Norm"}
    status, attrs, _ = parse("ai.onnx::18::OmRotaryPositionEmbedding", pb2json(mode=0))
    assert status == 0 and attrs == {"mode": "int 0"}
    pfa = dict(num_heads=9, input_layout="BNSD", scale_value=0.125, pre_tokens=2**31 - 1, next_tokens=0,
               num_key_value_heads=3, sparse_mode=0, inner_precise=0)
    status, attrs, _ = parse("ai.onnx::18::NPUPromptFlashAttention", pb2json(**pfa))
    assert status == 0 and attrs == {"num_heads": "int 9", "input_layout": "string BNSD", "scale_value": "float 0.125",
                                     "pre_tokens": "int 2147483647", "next_tokens": "int 0",
                                     "num_key_value_heads": "int 3", "sparse_mode": "int 0", "inner_precise": "int 0"}
    # a missing attribute or a malformed JSON fails the parse (ATC reports E11010) and says why
    status, _, err = parse("ai.onnx::18::OmFusedInferAttentionScore", pb2json(scale=0.125, num_heads=9))
    assert status == FAILED and "no int attribute 'num_key_value_heads'" in err
    status, _, err = parse("ai.onnx::18::OmRmsNorm", "{not json")
    assert status == FAILED and "not the JSON object expected" in err
    status, _, err = parse("ai.onnx::18::OmRmsNorm", pb2json(epsilon="tiny"))  # wrong kind: string, not float
    assert status == FAILED and "no float attribute 'epsilon'" in err



def test_real_lowering_renders_plugins_that_compile(tiny_ascend_step: tuple[dict, Path], tmp_path: Path) -> None:
    lowering, _ = tiny_ascend_step
    project = atc_plugins.render_plugins(lowering, tmp_path / "plugins")
    assert project is not None
    assert [op.op_type for op in project.ops] == ["NPUPromptFlashAttention", "OmAddRmsNorm",
                                                  "OmFusedInferAttentionScore", "OmRmsNorm",
                                                  "OmRotaryPositionEmbedding", "OmScatterPaKvCache", "SwiGlu"]
    assert all(op.onnx_key == f"ai.onnx::18::{op.op_type}" for op in project.ops)
    if GXX is None:
        pytest.skip("g++ is not installed: rendered, not syntax-checked")
    sources = [p for p in project.files if p.suffix == ".cc"]
    result = gxx("-fsyntax-only", "-I", STUBS, "-I", STUBS / "json_stub", "-I", project.dir, *sources)
    assert result.returncode == 0, result.stderr
