"""The `poss` command. Each subcommand lives beside the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# Each module defines `add_subcommand(subparsers)` that sets `func` on its parser.
SUBCOMMAND_MODULES = (
    "transformers_poss.evaluation.demo",
    "transformers_poss.assets",
    "transformers_poss.evaluation.cli",
    "transformers_poss.evaluation.compare",
    "transformers_poss.evaluation.turns",
    "transformers_poss.training.cli",
    "transformers_poss.hub",
    "transformers_poss.checkpoints.cli",
    "transformers_poss.tuning",
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="poss",
        description="PosS (Position Specialists) speculative decoding for HuggingFace Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"transformers-poss {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_subcommand(subparsers)
    return parser


def typed_command() -> str:
    """The running command as a user would retype it, for result records: `poss ...` when it came through this
    command (the console script or `python -m transformers_poss.cli`, not their install paths), else argv as given."""
    program = "poss" if Path(sys.argv[0]).name in ("poss", Path(__file__).name) else sys.argv[0]
    return " ".join([program, *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
