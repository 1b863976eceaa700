"""Batch-1 A/B of the tree loop: the single-prompt loop before the architecture pass against the one loop now.

The old loop is read from git (`generation/tree_decoding.py` at `--base`, imports adjusted to today's modules) and
both run in this process on the same target and drafter, alternating per turn (old, new, then new, old on the next),
so drift slows them alike. Turns: the first `--limit` MT-Bench questions, the first turn and the follow-up (the
follow-up's history is the plain answer). Prints per-turn times, the median ratio new / old, and whether the answers
are identical.

    python benchmarks/cpu-bf16-one-loop/loop_ab.py --prompts ../shared/data/specbench/mt_bench.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from transformers_poss.assets import load_default_drafter, load_default_target, resolve_dtype
from transformers_poss.evaluation.prompts import chat_prompt, load_prompt_sets
from transformers_poss.generation import hook

OLD_PATH = "src/transformers_poss/generation/tree_decoding.py"
IMPORTS = {
    "from ..modeling_poss import PosSDrafter, additive_mask, output_logits":
        "from transformers_poss.layers import additive_mask, output_logits\n"
        "from transformers_poss.modeling_poss import PosSDrafter",
    "from .drafting import": "from transformers_poss.generation.drafting import",
    "from .stats import GenerationStats, PosSGenerateOutput, RoundTrace":
        "from transformers_poss.generation.stats import GenerationStats, PosSGenerateOutput\n"
        "from transformers_poss.generation.decoding import RoundTrace",
    "budget.tree_total_tokens, budget.deep_draft_vocab)": "budget.tree_total_tokens)",
    """stats = GenerationStats(draft_mode="tree", tree_depth=budget.tree_depth,
                            round_traces=[] if budget.record_round_traces else None)""":
        'stats = GenerationStats(draft_mode="tree", tree_depth=budget.tree_depth)',
    "if stats.round_traces is not None:": "if False:",
}


def old_loop(base: str):
    """`tree_assisted_decoding` of the single-prompt loop at commit `base`."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout
    source = subprocess.run(["git", "show", f"{base}:{OLD_PATH}"], cwd=root.strip(), capture_output=True, text=True,
                            check=True).stdout
    for old, new in IMPORTS.items():
        if old not in source:
            raise SystemExit(f"the old loop at {base} lacks {old!r}: adjust IMPORTS")
        source = source.replace(old, new)
    path = Path(tempfile.mkdtemp()) / "old_tree_decoding.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_tree_decoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tree_assisted_decoding


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--base", default="020766b", help="commit of the old single-prompt loop")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loops = {"old": old_loop(args.base), "new": hook.tree_assisted_decoding}
    target, tokenizer = load_default_target(dtype=resolve_dtype(args.dtype))
    drafter = load_default_drafter("poss2", target)
    questions = [q for qs in load_prompt_sets(args.prompts, limit=args.limit).values() for q in qs]

    def generate(ids, loop=None):
        if loop is not None:
            hook.tree_assisted_decoding = loops[loop]
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=None if loop is None else drafter)
        return out[0, ids.shape[1]:], time.perf_counter() - start

    warm_up = tokenizer(chat_prompt(tokenizer, ["Hi"], []), return_tensors="pt").input_ids
    for loop in (None, "old", "new"):
        generate(warm_up, loop)
    ratios, identical, turns = [], 0, 0
    print("| turn | old s | new s | new / old | identical |\n|---|---|---|---|---|")
    for number, question in enumerate(questions):
        history = []
        for turn, text in enumerate(question.turns[:2]):
            ids = tokenizer(chat_prompt(tokenizer, question.turns[: turn + 1], history), return_tensors="pt").input_ids
            order = ("old", "new") if (number + turn) % 2 == 0 else ("new", "old")
            results = {loop: generate(ids, loop) for loop in order}
            plain, _ = generate(ids)
            history.append(tokenizer.decode(plain, skip_special_tokens=True))
            same = torch.equal(results["old"][0], results["new"][0])
            ratio = results["new"][1] / results["old"][1]
            ratios.append(ratio)
            identical += same
            turns += 1
            print(f"| {question.question_id}/{turn + 1} | {results['old'][1]:.2f} | {results['new'][1]:.2f} | "
                  f"{ratio:.3f} | {same} |", flush=True)
    hook.tree_assisted_decoding = loops["new"]
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"\nmedian new / old {statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f} - {quartiles[2]:.3f}), "
          f"{identical}/{turns} answers identical; {sys.argv[0]} --base {args.base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
