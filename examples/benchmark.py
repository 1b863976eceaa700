"""Benchmark PosS drafters against plain `generate`, prompt lookup and an assistant model (same as `poss bench`).

    python examples/benchmark.py --target default --drafter default --prompts path/to/specbench --limit 2 \
        --max-new-tokens 32

Writes a markdown table to stdout, and results.json, acceptance.png and speedup.png to --output-dir.
"""

import sys

from transformers_poss.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
