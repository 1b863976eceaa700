"""Time and profile repeated draft rounds of a drafter on one committed context (the default target, bf16).

    python benchmarks/scripts/draft_profile.py --depth 6 --top-k 4 --total 12 [--deep-vocab 4096] [--cold] [--profile]

Commits a 300-token context, drafts the same tree `--rounds` times (each round dropped afterwards, as between real
rounds) and prints the median round time and time per depth; `--profile` adds torch profiler tables by operator and
by operator and input shape.
"""

import argparse
import statistics
import time

import torch

from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path, load_default_target
from transformers_poss.generation.drafting import DraftSession, draft_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="drafter folder (default: the shipped PosS-2)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--total", type=int, default=12)
    parser.add_argument("--cold", action="store_true",
                        help="stream 300 MB through the cache before each round, as a target forward does")
    parser.add_argument("--int8", action="store_true", help="int8_draft_weights: 8-bit copies of the draft weights")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = PosSDrafter.from_pretrained(args.drafter or default_drafter_path("poss2"),
                                          int8_draft_weights=args.int8).eval().bind(target)
    text = "Explain in detail how a CPU cache hierarchy works and why it matters for performance. " * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :300]
    with torch.no_grad():
        out = target(input_ids=ids[:, :-1], output_hidden_states=drafter.config.input_feature_layers,
                     logits_to_keep=1)
    session = DraftSession(drafter)
    session.commit(drafter.target_features(out.hidden_states)[0], ids[0, 1:])

    flush = torch.zeros(75_000_000) if args.cold else None

    def one_round():
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        draft_tree(session, ids[0, -1], args.depth, args.top_k, args.total)
        session.end_round()
        return time.perf_counter() - start

    for _ in range(5):
        one_round()
    times = []
    for _ in range(args.rounds):
        times.append(one_round())
    median = statistics.median(times)
    print(f"depth {args.depth} / top-k {args.top_k} / {args.total} tokens: {median * 1e3:.2f} ms per round, "
          f"{median * 1e3 / args.depth:.2f} ms per depth")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10):
                one_round()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
