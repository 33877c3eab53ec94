"""`python3 -m moeserve.bench ...`: the bench command without the moeserve CLI."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from moeserve.bench.cli import EXIT_USAGE, add_bench_arguments, run_bench


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage dump), exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(
        prog="moeserve bench", description="Benchmark an OpenAI-compatible server."
    )
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
