"""The `poss` command. Each subcommand lives beside the code it drives and registers itself here.

The dependency runs one way: this module imports the subcommand modules, they never import it (what they share is
in `transformers_poss._cli_common`; tests/test_imports.py checks).
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
