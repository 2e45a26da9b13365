"""The ``omforge`` command line: one subcommand per stage the user drives.

Every user-fixable error (:class:`omforge.errors.OmforgeError`, a missing file) prints one line,
``omforge: error: …``, and exits with code 2; no traceback. ``diff`` exits 1 when the drift exceeds its
tolerance, and says so in its last line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omforge.contract.serve_options import SERVE_GROUPS, SERVE_OPTIONS, ServeOption
from omforge.errors import OmforgeError

EXIT_USAGE = 2
EXIT_ATC_LEFT = 3  # compile --target ascend finished everything but the ATC step (no atc on PATH)
RUNTIME_LORA_ENV = "OMFORGE_ALLOW_RUNTIME_LORA_UPDATING"  # 1 or true: --enable-runtime-lora (vLLM's VLLM_ALLOW_…)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cmd_export(args: argparse.Namespace) -> int:
    from omforge.export.onnx_export import export_recipe
    from omforge.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    t0 = time.perf_counter()
    meta = export_recipe(recipe, Path(args.output))
    print(f"exported {recipe.model.name} to {args.output}: {meta['num_nodes']} nodes, opset {meta['opset']}, "
          f"{time.perf_counter() - t0:.1f}s, peak RSS {_peak_rss_mb():.0f} MB")
    return 0


def _load_exported(target: str):  # noqa: ANN202 - ExportedModel (imported lazily)
    from omforge.runtime.full_recompute import ExportedModel

    path = Path(target)
    if not path.exists():
        raise OmforgeError(f"{target}: no such recipe or export directory")
    if path.is_dir():
        return ExportedModel(path)
    if path.suffix in (".yaml", ".yml"):
        from omforge.compile.cache import cache_root
        from omforge.export.onnx_export import cached_export
        from omforge.recipe import load_recipe

        return ExportedModel(cached_export(load_recipe(path), cache_root() / "exports"))
    raise OmforgeError(f"{target}: expected a recipe (.yaml) or an export directory")


def _generate_with_engine(args: argparse.Namespace) -> int:
    from omforge.runtime.llm import LLM
    from omforge.runtime.sampling_params import SamplingParams

    llm = LLM(args.target)
    if llm.tokenizer is None:
        raise OmforgeError(f"{args.target}: this bundle has no tokenizer")
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]),
                                      add_special_tokens=False)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            seed=args.seed)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = (out.token_times[-1] - out.arrival_time) if out.token_times else 0.0
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "prompt_tokens": len(out.prompt_token_ids), "ttft": round(out.ttft or 0.0, 4),
                          "seconds": round(seconds, 3)}))
    else:
        print(out.text)
        print(f"[{len(out.prompt_token_ids)} prompt + {len(out.token_ids)} generated tokens, finish="
              f"{out.finish_reason}, TTFT {1e3 * (out.ttft or 0):.0f} ms, {seconds:.2f}s, paged engine]",
              file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if (Path(args.target) / "manifest.json").is_file():
        return _generate_with_engine(args)
    model = _load_exported(args.target)
    if model.tokenizer is None:
        raise OmforgeError(f"{args.target}: this model has no tokenizer; give model.tokenizer in the recipe")
    if args.chat:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt_ids = model.tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = model.tokenizer.encode(args.prompt)
    gen = model.greedy(prompt_ids, args.max_tokens, ignore_eos=args.ignore_eos)
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.token_ids, "finish_reason": gen.finish_reason,
                          "prompt_tokens": len(prompt_ids), "seconds": round(gen.seconds, 3)}))
    else:
        print(gen.text)
        print(f"[{len(prompt_ids)} prompt + {len(gen.token_ids)} generated tokens, finish={gen.finish_reason}, "
              f"{gen.seconds:.2f}s, full recompute]", file=sys.stderr)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from omforge.diff import bundles

    if args.b and bundles.is_bundle(Path(args.a)) and bundles.is_bundle(Path(args.b)):
        result = bundles.diff_bundles(Path(args.a), Path(args.b), max_tokens=args.max_tokens)
        print(json.dumps(result.to_dict(), indent=2) if args.json else bundles.render_text(result))
        return 0 if result.max_abs <= args.tol else 1
    from omforge.diff import graphs, render
    from omforge.diff.types import DiffOptions

    if args.html and not Path(args.html).resolve().parent.is_dir():
        raise OmforgeError(f"{args.html}: its directory does not exist")
    options = DiffOptions(seq=args.seq, batch=args.batch, seed=args.seed, tol=args.tol, per_fusion=args.per_fusion)
    result = graphs.run(Path(args.a), Path(args.b) if args.b else None, options,
                        progress=lambda msg: print(f"[diff] {msg} …", file=sys.stderr, flush=True))
    if args.html:
        Path(args.html).write_text(render.render_html(result))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        print(result.verdict, file=sys.stderr)
    else:
        print(render.render_text(result))
        if args.html:
            print(f"HTML report: {args.html}")
        print(result.verdict)
    return 0 if result.passed else 1


def require_export_extra() -> None:
    """Fail before any work when the graph tooling every compile needs (the passes) is missing."""
    import importlib.util

    for name in ("onnx_ir", "onnxscript"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def cmd_compile(args: argparse.Namespace) -> int:
    from omforge.compile.compiler import compile_recipe
    from omforge.recipe import load_recipe

    require_export_extra()
    recipe = load_recipe(args.recipe)
    out = Path(args.output) if args.output else Path("build") / recipe.model.name
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # checked before the export's minutes, not as a NotADirectoryError after them
        raise OmforgeError(f"-o {out}: {blocker} is a file, not a directory; name a directory for the bundle")
    t0 = time.perf_counter()
    try:
        result = compile_recipe(recipe, out, target=args.target)
    except OmforgeError as e:
        from omforge.compile.ascend.atc import AtcMissing

        if not isinstance(e, AtcMissing):
            raise
        print(f"omforge: the bundle at {out} is complete up to the ATC step, which is left: {e}", file=sys.stderr)
        return EXIT_ATC_LEFT
    size = sum(f.size for f in result.manifest.files.values())
    cached = ", ".join(k for k, v in result.cached.items() if v) or "none"
    print(f"compiled {recipe.model.name} for {result.manifest.target} into {out}: {size / 1e6:.0f} MB, "
          f"{time.perf_counter() - t0:.1f}s (cached stages: {cached})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from omforge.compile.bundle import describe
    from omforge.contract.manifest import load_manifest

    manifest = load_manifest(Path(args.bundle), verify=not args.no_verify)
    conformance, rows, outside = None, [], []
    if manifest.target == "ascend":  # CANN's rules over the ATC step's inputs, checked without CANN
        from omforge.compile.ascend.atc_conformance import check_bundle
        from omforge.compile.ascend.cann_matrix import bundle_rows

        conformance = check_bundle(Path(args.bundle))
        rows, outside = bundle_rows(Path(args.bundle))
    if args.json:
        data = manifest.to_dict()
        if conformance is not None:
            data["atc_conformance"] = {
                out: [{"rule": r.rule, "source": r.source, "ok": r.ok, "detail": r.detail} for r in results]
                for out, results in conformance.items()}
            data["cann_matrix"] = {"rows": [{"key": r.key_text, "ge_type": r.ge_type, "parsed_at": str(r.parsed_at),
                                             "dtypes_at": str(r.dtypes_at)} for r in rows],
                                   "outside": outside}
        print(json.dumps(data, indent=2))
    else:
        print(describe(manifest))
        if manifest.ascend is not None and manifest.kv is not None:  # what its attention reads per decode step
            from omforge.runtime.ascend.attention_bytes import inspect_line

            print(inspect_line(manifest, args.batch, args.context))
        for out, results in (conformance or {}).items():
            print(f"  ATC conformance of --output={out} (CANN's rules, checked here without CANN; passing them is "
                  "necessary, not sufficient: nothing of this has run on an NPU)")
            for r in results:
                print(f"    {r.line()}")
        if conformance is not None:
            print(f"  CANN matrix rows the step graph relies on ({len(rows)}; docs/ascend-conformance.md)")
            for r in rows:
                print(f"    {r.key_text:40s} -> {r.ge_type:24s} [{r.parsed_at}]")
            for line in outside:
                print(f"    FAIL outside the matrix: {line}")
    failed = [r for results in (conformance or {}).values() for r in results if not r.ok]
    return 1 if failed or outside else 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from omforge.serve.server import ServeOptions, serve

    if not (Path(args.bundle) / "manifest.json").is_file():
        raise OmforgeError(f"{args.bundle}: not a bundle (no manifest.json); build one with omforge compile RECIPE")
    if args.max_request_body_bytes < 1:
        raise OmforgeError(f"--max-request-body-bytes must be positive, got {args.max_request_body_bytes}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise OmforgeError(f"{flag} must be a positive number of seconds, got {value:g}")
    if not args.drain_timeout >= 0:
        raise OmforgeError(f"--drain-timeout must be 0 or more seconds, got {args.drain_timeout:g}")
    options = ServeOptions(host=args.host, port=args.port, api_key=args.api_key or os.environ.get("OMFORGE_API_KEY"),
                           served_model_name=args.served_model_name, drain_timeout=args.drain_timeout,
                           log_level=args.log_level, tool_call_parser=args.tool_call_parser,
                           body_timeout=args.body_timeout, max_request_body_bytes=args.max_request_body_bytes,
                           header_timeout=args.header_timeout)
    if args.enable_runtime_lora is None and os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true"):
        args.enable_runtime_lora = True
    engine_options = {}
    for o in SERVE_OPTIONS:  # None: not given, the bundle's value
        value = getattr(args, o.name) if o.cli_flag else None
        if value is not None and o.nargs:
            value = _pairs(o, value) if o.kind is dict else list(value)
        elif value is not None and o.kind is dict:
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise OmforgeError(f"{o.cli_flag}: not JSON ({e})") from None
        if value is not None:
            _check_range(o, value)
            engine_options[o.name] = value
    return serve(args.bundle, options, **engine_options)


def _pairs(o: ServeOption, words: list[str]) -> dict[str, str]:
    """A ``nargs`` option's ``NAME=VALUE`` words as a dict; a word without ``=`` or a name given twice is one line
    naming the flag."""
    pairs: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or not name or not value:
            raise OmforgeError(f"{o.cli_flag}: expected {o.metavar or 'NAME=VALUE'}, got {word!r}")
        if name in pairs:
            raise OmforgeError(f"{o.cli_flag}: {name!r} is given twice")
        pairs[name] = value
    return pairs


def _check_range(o: ServeOption, value: Any) -> None:
    """A number given on the command line within the option's declared range (the recipe's schema checks the
    same bounds), else one line naming the flag."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    for bound, ok, what in ((o.ge, lambda b: value >= b, "at least"), (o.gt, lambda b: value > b, "more than"),
                            (o.le, lambda b: value <= b, "at most")):
        if bound is not None and not ok(bound):
            raise OmforgeError(f"{o.cli_flag}: must be {what} {bound:g}, got {value:g}")


def cmd_verify(args: argparse.Namespace) -> int:
    from omforge.verify import verify

    require_export_extra()  # the plain twin is lowered here
    return 0 if verify(Path(args.bundle), Path(args.recipe), device=args.device) else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from omforge.doctor import gather, render

    report = gather()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


_Subparsers = argparse._SubParsersAction  # what add_subparsers returns


class _ExactParser(argparse.ArgumentParser):
    """A subcommand's parser: long options only as spelt in full (``allow_abbrev`` off)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omforge", description="Compile Llama-family LLMs to fused, paged-KV "
                                "ONNX Runtime / Ascend OM artifacts and serve them.", allow_abbrev=False)
    # abbreviations off everywhere (a misspelt --max-num-seq is an error, not --max-num-seqs): every subcommand's
    # parser is made with allow_abbrev=False too
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_ExactParser)
    _compile_parser(sub)
    _inspect_parser(sub)
    _serve_parser(sub)
    _doctor_parser(sub)
    _verify_parser(sub)
    _export_parser(sub)
    _generate_parser(sub)
    _diff_parser(sub)
    return p


def _compile_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("compile",
                       help="recipe → export → passes → lowering → bundle (ort, or ascend up to/through ATC)")
    p.add_argument("recipe", help="recipe file, e.g. models/smollm2-135m.yaml")
    p.add_argument("-o", "--output", help="bundle directory (default build/<model name>)")
    p.add_argument("--target", choices=["ort", "ascend"], help="override compile.target")
    p.set_defaults(func=cmd_compile)


def _positive(text: str) -> int:
    """An argparse type: a positive integer (argparse reports anything else in one line)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _inspect_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("inspect", help="print a bundle's manifest readably (checks its version and file hashes)")
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true", help="the whole manifest as JSON")
    p.add_argument("--no-verify", action="store_true", help="skip re-hashing the files (sizes are still checked)")
    p.add_argument("--batch", type=_positive, default=32,
                   help="ascend: the decode batch the attention bytes are counted at (default 32)")
    p.add_argument("--context", type=_positive, default=4096,
                   help="ascend: the context per sequence the attention bytes are counted at (default 4096)")
    p.set_defaults(func=cmd_inspect)


def _serve_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API (completions, chat, "
                       "streaming, /metrics)")
    p.add_argument("bundle", help="a bundle directory (omforge compile's output)")
    groups = {title: p.add_argument_group(title, description) for title, description in SERVE_GROUPS}
    _serve_option_flags(groups)
    api, http = groups["API"], groups["HTTP"]
    api.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 (default $OMFORGE_API_KEY, or none)")
    api.add_argument("--served-model-name", help="the model id clients send (default the recipe's model name)")
    api.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                     help="the format the model writes tool calls in (default: detected from its chat template)")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    http.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    http.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                      help="seconds a connection gets to send a request's headers; past it the connection is closed "
                      "(default 10)")
    http.add_argument("--body-timeout", type=float, default=30.0,
                      help="seconds a client gets to send a request body before a 408 (default 30)")
    http.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                      help="the largest request body accepted; a larger one gets a 413 (default 8388608, 8 MiB)")
    http.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get to finish "
                      "after SIGTERM (default 30)")
    http.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def _serve_option_flags(groups: dict[str, Any]) -> None:
    """One flag per serve option of contract/serve_options.py (default None: the bundle's value), in its group."""
    for o in SERVE_OPTIONS:
        if o.cli_flag is None:
            continue
        p = groups[o.group]
        default = "" if o.default is None else f"; recipe default {o.default}"
        where = f" (overrides the bundle's serve.{o.name}{default})" if o.recipe else ""
        common = {"dest": o.name, "default": None, "help": o.help + where}
        if o.kind is bool:
            p.add_argument(o.cli_flag, action=argparse.BooleanOptionalAction, **common)
        elif o.nargs:
            p.add_argument(o.cli_flag, nargs=o.nargs, metavar=o.metavar, **common)
        else:
            p.add_argument(o.cli_flag, type=_flag_type(o), choices=o.choices or None, metavar=o.metavar, **common)


def _flag_type(o: ServeOption) -> Callable[[str], Any]:
    """How a serve option's flag reads its text: as the option's kind (a dict option's JSON is read by cmd_serve),
    or, for an option with words (``auto``), a positive number, one of the words or ``none`` (no bound)."""
    if not o.words:
        return str if o.kind is dict else o.kind
    words = (*o.words, "none") if o.nullable else o.words

    def number_or_word(text: str) -> Any:
        if text in words:
            return text
        try:
            value = o.kind(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive number, {' or '.join(map(repr, words))}, got "
                                             f"{text!r}")
        return value

    return number_or_word


def _doctor_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("doctor", help="what this machine has (packages, providers, CANN, pyACL, NPUs) and which "
                       "targets it can compile and run")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.set_defaults(func=cmd_doctor)


def _verify_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("verify", help="first run of an ascend bundle on an NPU: every gear once against the ORT plain "
                       "twin, pass/fail per gear and the device memory used against the plan (exit 0/1)")
    p.add_argument("bundle", help="an ascend bundle whose OM was built")
    p.add_argument("--recipe", required=True, help="the recipe it was compiled from (the twin is lowered from it)")
    p.add_argument("--device", type=int, default=0, help="NPU id (default 0)")
    p.set_defaults(func=cmd_verify)


def _export_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("export", help="recipe → unfused ONNX graph (primitive ops, external weights)")
    p.add_argument("recipe", help="recipe file, e.g. models/smollm2-135m.yaml")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.set_defaults(func=cmd_export)


def _generate_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("generate", help="generate from a bundle (the paged engine), or greedily from a recipe or "
                       "export over the unfused graph (full-recompute smoke path)")
    p.add_argument("target", help="a bundle directory, a recipe (exported once into the cache) or an export directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="bundle only (0 = greedy)")
    p.add_argument("--seed", type=int, default=None, help="bundle only")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings)")
    p.set_defaults(func=cmd_generate)


def _diff_parser(sub: _Subparsers) -> None:
    p = sub.add_parser("diff", help="fused vs unfused: op histograms, fused regions, numeric drift (exit 1 over --tol)")
    p.add_argument("a", metavar="A", help="the reference ONNX graph, or an export directory (then B is its fused "
                   "graph, built on the fly)")
    p.add_argument("b", metavar="B", nargs="?", help="the ONNX graph to compare (same inputs and outputs as A); "
                   "with two bundles (e.g. float32 vs bfloat16 KV cache): their greedy outputs and logits on 20 chat "
                   "prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="two bundles: greedy tokens per prompt (default 64)")
    p.add_argument("--per-fusion", action="store_true", help="export directory only: build a graph per fusion "
                   "and report each one's drift")
    p.add_argument("--seq", type=int, default=32, help="tokens per row of the random input (default 32)")
    p.add_argument("--batch", type=int, default=1, help="rows of the random input (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    p.add_argument("--tol", type=float, default=1e-3, help="largest max-abs drift that passes (default 1e-3)")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    p.set_defaults(func=cmd_diff)


EXPORT_EXTRA_MODULES = frozenset({"torch", "onnx_ir", "onnxscript", "onnxsim", "gguf", "safetensors", "transformers",
                                  "ml_dtypes"})
"""What ``pip install 'omforge[export]'`` brings (pyproject.toml): export, compile, diff of graphs need it; serving
a bundle does not."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        print("omforge: error: --max-tokens must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except OmforgeError as e:
        print(f"omforge: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as e:
        print(f"omforge: error: {e.filename or e}: file not found", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:  # an extra this command needs is not installed: say which, in one line
        root = (e.name or "").split(".")[0]
        if root not in EXPORT_EXTRA_MODULES:
            raise
        print(f"omforge: error: `omforge {args.command}` needs the export extra (no module '{root}'): "
              "pip install torch==2.13.0 && pip install 'omforge[export]'", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
