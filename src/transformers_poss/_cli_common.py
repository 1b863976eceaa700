"""Helpers shared by the modules that define `poss` subcommands.

`transformers_poss.cli` imports the subcommand modules (to register them); they import what they share from here,
never from `cli`, so the dependency runs one way. This module imports nothing from the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

# What `sys.argv[0]` ends with when the run came through the `poss` command: the console script, or
# `python -m transformers_poss.cli` (argv[0] is then the path of cli.py).
POSS_COMMAND_PROGRAMS = ("poss", "cli.py")


def typed_command() -> str:
    """The running command as a user would retype it, for result records: `poss ...` when it came through the `poss`
    command (the console script or `python -m transformers_poss.cli`, not their install paths), else argv as given."""
    program = "poss" if Path(sys.argv[0]).name in POSS_COMMAND_PROGRAMS else sys.argv[0]
    return " ".join([program, *sys.argv[1:]])
