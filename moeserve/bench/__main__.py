"""`python3 -m moeserve.bench ...`: the bench command without the moeserve CLI."""

from __future__ import annotations

import sys

from moeserve.bench.cli import OneLineErrorParser, add_bench_arguments, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(
        prog="moeserve bench", description="Benchmark an OpenAI-compatible server."
    )
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
