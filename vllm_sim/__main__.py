"""``python -m vllm_sim --port 9001 --time-scale 0.01``: one simulated vLLM replica."""

from __future__ import annotations

import argparse
import sys

from vllm_sim.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm_sim", description="A vLLM-compatible replica simulator.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
