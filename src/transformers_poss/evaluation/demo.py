"""`poss demo`: the default target with and without a drafter, side by side, on a few chat turns."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..assets import (
    DEFAULT_DRAFTERS, DEFAULT_TARGET_NAME, DTYPES, default_drafter_path, load_default_drafter, load_default_target,
    load_drafter, resolve_dtype,
)
from ..devices import device_kind
from ..generation_config import resolve_budget
from ..metrics import mean_acceptance_length, position_acceptance
from .losslessness import compare_tokens, default_tolerance, greedy_consistency

# `poss demo`'s conversations: a new question, then a follow-up that asks for the answer reworked. Chat users do
# both, and the two differ a lot: where an answer repeats text from its context, the drafter's prompt-lookup branch
# copies it (docs/results.md has both kinds' figures), so the demo shows both kinds and reports them apart.
DEMO_CONVERSATIONS = (
    ("Explain in three sentences why the sky is blue.",
     "Rewrite your explanation so that a ten-year-old can follow it."),
    ("Write a Python function that returns the n-th Fibonacci number.",
     "Add a docstring and type hints to your function."),
    ("Give me a short packing list for a weekend hiking trip.",
     "Rewrite the list, adding after each item why it matters."),
)



def _timed_generate(target, input_ids, max_new_tokens, drafter=None):
    """`(generated tokens [n], seconds, speculative_stats or None)` of one greedy `generate` call."""
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                              do_sample=False, assistant_model=drafter, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    return out.sequences[0, input_ids.shape[1]:], seconds, getattr(out, "speculative_stats", None)


def demo_summary(turns: list[dict], depth: int) -> list[dict]:
    """Per kind of turn ("new questions", "follow-ups", "all"): tokens/s of both, speedup, tau and alpha_p pooled
    over rounds, accepted tokens from the lookup branch alone. `turns`: dicts with `follow_up`, `plain_tokens`,
    `plain_s`, `poss_tokens`, `poss_s`, `acceptance_lengths`, `lookup_tokens`."""
    rows = []
    for kind, keep in (("new questions", lambda t: not t["follow_up"]), ("follow-ups", lambda t: t["follow_up"]),
                       ("all", lambda t: True)):
        chosen = [t for t in turns if keep(t)]
        if not chosen:
            continue
        lengths = [a for t in chosen for a in t["acceptance_lengths"]]
        plain_rate = sum(t["plain_tokens"] for t in chosen) / sum(t["plain_s"] for t in chosen)
        poss_rate = sum(t["poss_tokens"] for t in chosen) / sum(t["poss_s"] for t in chosen)
        rows.append({"kind": kind, "turns": len(chosen), "plain_rate": plain_rate, "poss_rate": poss_rate,
                     "speedup": poss_rate / plain_rate, "rounds": len(lengths),
                     "tau": mean_acceptance_length(lengths), "alphas": position_acceptance(lengths, depth),
                     "lookup_tokens": sum(t["lookup_tokens"] for t in chosen)})
    return rows


def _demo_turn(target, tokenizer, drafter, messages, max_new_tokens, tolerance) -> dict:
    """Answer `messages` with plain greedy `generate` and with the drafter; print both and the checks."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(target.device)
    plain, plain_s, _ = _timed_generate(target, ids, max_new_tokens)
    spec, spec_s, stats = _timed_generate(target, ids, max_new_tokens, drafter)
    match = compare_tokens(plain, spec)
    check = greedy_consistency(target, torch.cat((ids[0], spec)), ids.shape[1], tolerance, reference=plain)
    plain_text = tokenizer.decode(plain, skip_special_tokens=True)
    print(("Follow-up: " if len(messages) > 1 else "Question: ") + messages[-1]["content"])
    print(f"  plain : {len(plain) / plain_s:6.1f} tok/s | {plain_text!r}")
    print(f"  PosS  : {len(spec) / spec_s:6.1f} tok/s | tau {stats.mean_acceptance_length:.2f}"
          + (f", {stats.lookup_tokens} tokens from the lookup branch alone" if stats.lookup_tokens else ""))
    if match["identical"]:
        print("  outputs identical token for token\n", flush=True)
    else:
        print(f"  outputs part at token {match['first_mismatch']} "
              f"(PosS: {tokenizer.decode(spec, skip_special_tokens=True)!r})")
        verdict = "greedy-consistent" if check["consistent"] else f"NOT greedy-consistent ({check['tokens_over']} over)"
        if check["not_argmax"]:
            detail = (f"{check['not_argmax']} of its {check['checked']} tokens score below plain generate's choice at "
                      f"their prefix, by at most {check['max_gap']:.3f} logit")
        else:
            detail = "every token scores as high as plain generate's choice at its prefix (it parts at an exact tie)"
        print(f"  {verdict} (tolerance {tolerance} logit): {detail}\n", flush=True)
    return {"follow_up": len(messages) > 1, "plain_tokens": len(plain), "plain_s": plain_s, "poss_tokens": len(spec),
            "poss_s": spec_s, "acceptance_lengths": list(stats.acceptance_lengths),
            "lookup_tokens": stats.lookup_tokens, "identical": match["identical"], "consistent": check["consistent"],
            "plain_text": plain_text}


def run_demo(args) -> int:
    drafter_path = Path(args.drafter).expanduser() if args.drafter else default_drafter_path("poss2")
    if not (drafter_path / "config.json").is_file():  # before the slow target load
        if args.drafter:
            print(f"poss demo: {drafter_path} is not a drafter folder (no config.json)", file=sys.stderr)
        else:
            try:
                load_default_drafter("poss2")
            except FileNotFoundError as error:
                print(f"poss demo: {error}", file=sys.stderr)
        return 2
    if args.max_new_tokens < 1:
        print(f"poss demo: --max-new-tokens must be >= 1, got {args.max_new_tokens}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    print(f"Loading {DEFAULT_TARGET_NAME} ({str(dtype).removeprefix('torch.')}) ...", flush=True)
    target, tokenizer = load_default_target(dtype=dtype)
    drafter = load_drafter(drafter_path).eval()
    drafter.bind(target)  # checked against the target, moved beside its lm_head
    drafter = drafter.with_generation_config(draft_mode=args.mode)  # this run's mode; the folder is left as it is
    budget, _ = resolve_budget(drafter.generation_config, device_kind(target.device, target.dtype))
    drafter_name = str(drafter_path) if args.drafter else f"shipped {DEFAULT_DRAFTERS['poss2']}"
    print(f"Drafter: {drafter_name} ({drafter.generation_config.draft_mode} mode, depth {budget['tree_depth']}, "
          f"top-k {budget['tree_top_k']}, {budget['tree_total_tokens']} tree tokens, prompt-lookup branch of "
          f"{budget['lookup_num_tokens']} tokens)")
    print(f"{len(DEMO_CONVERSATIONS)} conversations: a new question, then a follow-up on plain generate's answer; "
          f"greedy, up to {args.max_new_tokens} new tokens a turn\n", flush=True)

    warm = tokenizer.apply_chat_template([{"role": "user", "content": DEMO_CONVERSATIONS[0][0]}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    warm = warm["input_ids"].to(target.device)
    _timed_generate(target, warm, 8)
    _timed_generate(target, warm, 8, drafter)
    tolerance = default_tolerance(dtype)
    turns = []
    for question, follow_up in DEMO_CONVERSATIONS:
        messages = [{"role": "user", "content": question}]
        turns.append(_demo_turn(target, tokenizer, drafter, messages, args.max_new_tokens, tolerance))
        messages += [{"role": "assistant", "content": turns[-1]["plain_text"]}, {"role": "user", "content": follow_up}]
        turns.append(_demo_turn(target, tokenizer, drafter, messages, args.max_new_tokens, tolerance))

    print(f"{'turns':<16} {'plain tok/s':>11} {'PosS tok/s':>10} {'speedup':>8} {'tau':>5}  per-position acceptance")
    for row in demo_summary(turns, budget["tree_depth"]):
        print(f"{row['kind'] + ' (' + str(row['turns']) + ')':<16} {row['plain_rate']:>11.1f} {row['poss_rate']:>10.1f} "
              f"{row['speedup']:>7.2f}x {row['tau']:>5.2f}  "
              + " ".join(f"a{p}={a:.2f}" for p, a in enumerate(row["alphas"], start=1))
              + f"  ({row['rounds']} rounds, {row['lookup_tokens']} tokens from the lookup branch alone)")
    identical = sum(t["identical"] for t in turns)
    consistent = sum(t["consistent"] for t in turns)
    print(f"identical to plain generate: {identical}/{len(turns)}; greedy-consistent: {consistent}/{len(turns)} "
          f"(every token plain generate's choice at its prefix, or within {tolerance} logit of it)")
    if dtype != torch.float32:
        print("In bf16 a forward over several tokens rounds differently from one-token forwards, so verification can "
              "rank a near-tie the other way and the answers part there; --dtype float32 gives token identity.")
    print("Figures on more turns, and why follow-ups that rework an answer go faster: docs/results.md")
    return 0


def add_subcommand(subparsers) -> None:
    demo = subparsers.add_parser("demo",
                                 help="generate with and without the default drafter; compare outputs and speed")
    demo.add_argument("--drafter", default=None, help="drafter folder (default: the shipped PosS-2 drafter)")
    demo.add_argument("--max-new-tokens", type=int, default=128, help="per turn (as docs/results.md)")
    demo.add_argument("--mode", choices=("tree", "chain"), default="tree")
    demo.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                      help="auto: bfloat16 where the hardware computes it natively, else float32")
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    demo.set_defaults(func=run_demo)
