"""Train a PosS drafter: a thin front end of `transformers_poss.training` (same flags as `poss train`).

Single process:   python examples/train_poss.py --target TARGET --features FEATURES --output-dir runs/poss
Many GPUs/nodes:  accelerate launch [--num_processes N ...] examples/train_poss.py --target ... (no code changes)
                  or torchrun --nproc_per_node N examples/train_poss.py --target ...
Several CPUs:     torchrun --nproc_per_node N examples/train_poss.py --target ... (one gloo group, no GPU needed)
Resume:           the same command plus --resume latest (or --resume auto in job scripts)

See `python -c "import transformers_poss.training as t; help(t)"` for the whole recipe (features, warm start).
"""

import sys

from transformers_poss.training.cli import build_train_parser, run_train

if __name__ == "__main__":
    sys.exit(run_train(build_train_parser().parse_args()))
