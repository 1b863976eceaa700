"""`poss tune`: choose the tree budget that maximises tokens per second on this device kind.

A budget is only as good as the device it was measured on: `poss tune` writes its choice as the drafter's entry for
this device kind (`PosSGenerationConfig.device_budgets`, `transformers_poss.devices.device_kind`), next to the entries
of other kinds (run it once per kind, into the same folder), and its measurements into `tuning_record.json` under
the same kind. With `--batch-sizes` it also measures left-padded batches with the chosen budget and records the
largest batch size where drafting still beat plain batched `generate` (`max_batch_size`; 0 when not even one prompt
gains): `generate` decodes larger batches plainly.

The model. A round drafts a tree of depth `d`, width `k` and `T` nodes (root included), verifies it in one target
forward and emits `a + 1` tokens (`a` accepted drafts plus the target's own next token). Its expected speed is

    tokens/s(d, k, T) = E[a + 1 | d, k, T] / (draft_s(d, k) + verify_s(T) + overhead_s)

- `verify_s(T)`: median time of one target forward over `T` tree tokens on a cached context of the calibration
  prompts' typical length, with the tree attention mask, measured here.
- `draft_s(d, k)`: median time of `draft_tree` at depth `d` and width `k` on the same context, measured here,
  averaged over the calibration rounds at the depth each would reach: drafting stops early in rounds where a
  deeper level could not enter the tree (`drafted_depth`).
- `overhead_s`: what a real round costs beyond those two (acceptance, cache compaction, feature feedback, stopping
  checks): the median over calibration rounds of measured round time minus the two modelled parts.
- `E[a + 1]`: replayed, not guessed. For each width `k`, greedy generation on calibration prompts runs with the
  largest budget and records every round's scored candidates and the target's tokens. EAGLE-2's expansion at
  depth `j` does not depend on deeper levels or on `T`, so the tree of any smaller `(d, T)` is the best `T - 1`
  recorded candidates of depth <= `d`; its accepted length is the longest chain of them that matches the target's
  tokens. A chain that runs past the target tokens recorded for the round is cut there, so the estimate is a lower
  bound for budgets whose trees leave the calibrated one.

Plain decoding is timed on the same prompts (`target.generate`, greedy), so each budget also gets a predicted speedup.

The prompt-lookup branch (`lookup_num_tokens`) is measured, not modelled: with the chosen tree budget, `generate` runs
on the calibration prompts and, for questions with a second turn, on that follow-up after the target's own first
answer (where answers repeat what came before), once per branch length in `--lookup-tokens` (0: no branch) and
plainly, interleaved prompt by prompt; the entry gets the length with the highest measured speedup.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from ._cli_common import typed_command
from .generation.drafting import (DraftSession, DraftTree, draft_tree, level_rank, max_tree_nodes,
                                  select_candidates)
from .generation.decoding import RoundTrace, observe_rounds
from .generation.hook import UntunedDeviceWarning
from .generation.verification import tree_attention_mask


@dataclass
class BudgetEstimate:
    """Predicted behaviour of one tree budget."""

    depth: int
    top_k: int
    total_tokens: int
    tokens_per_round: float
    round_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_round / self.round_seconds


@dataclass
class TuneResult:
    """Everything `tune` measured and the budgets it ranked (best first)."""

    estimates: list[BudgetEstimate]
    decode_seconds_per_token: float
    verify_seconds: dict[int, float]
    draft_seconds: dict[tuple[int, int], float]
    overhead_seconds: float
    position_acceptance: dict[int, list[float]]
    calibration: dict = field(default_factory=dict)

    @property
    def best(self) -> BudgetEstimate:
        return self.estimates[0]

    def speedup(self, estimate: BudgetEstimate) -> float:
        return estimate.tokens_per_second * self.decode_seconds_per_token

    def record(self) -> dict:
        """The drafter's `tuning_record` (`tuning_record.json`)."""
        best = self.best
        return {
            "model": "tokens/s = E[accepted + 1] / (draft_s(depth, top_k) + verify_s(total_tokens) + overhead_s)",
            "chosen": {"tree_depth": best.depth, "tree_top_k": best.top_k, "tree_total_tokens": best.total_tokens},
            "predicted_tokens_per_round": round(best.tokens_per_round, 3),
            "predicted_tokens_per_second": round(best.tokens_per_second, 2),
            "predicted_speedup": round(self.speedup(best), 3),
            "decode_ms_per_token": round(self.decode_seconds_per_token * 1e3, 2),
            "verify_ms": {str(n): round(s * 1e3, 2) for n, s in self.verify_seconds.items()},
            "draft_ms": {f"{d},{k}": round(s * 1e3, 2) for (d, k), s in self.draft_seconds.items()},
            "overhead_ms": round(self.overhead_seconds * 1e3, 2),
            "position_acceptance": {str(k): [round(a, 4) if a == a else None for a in v]  # None: never reached
                                    for k, v in self.position_acceptance.items()},
            **self.calibration,
        }


# ---- replay ---------------------------------------------------------------------------------------------------
def subtree_candidates(candidates, depth: int, total_tokens: int) -> torch.LongTensor:
    """Indices of the candidates `draft_tree` keeps at this depth and size: the best `total_tokens - 1` of depth
    <= `depth`, in creation order."""
    eligible = (candidates.depths <= depth).nonzero().flatten()
    return eligible[select_candidates(candidates.scores[eligible], max(total_tokens - 1, 0))]


def stopping_ranks(candidates) -> list[float]:
    """For each level `j` of a recorded draft, the largest tree budget (draft nodes) that stops drafting after it
    (`level_rank`): how many candidates of depth <= j score at least level j's best; infinite where the recorded
    draft stopped (no level j + 1 was recorded), since a smaller budget stops there too."""
    scores, depths = candidates.scores, candidates.depths
    return [float(level_rank(scores[depths <= level][None], scores[depths == level].max()[None])[0])
            for level in range(1, int(depths.max()))] + [float("inf")]


def drafted_depth(ranks: list[float] | None, depth: int, total_tokens: int) -> int:
    """Levels `draft_tree` drafts at this depth and size, given the recorded draft's `stopping_ranks` (None: a
    root-only round): the first level whose rank reaches the budget, else `depth`."""
    if ranks is None or total_tokens <= 1:
        return 0
    budget = total_tokens - 1
    return next((level for level, rank in enumerate(ranks[: depth - 1], start=1) if rank >= budget), depth)


def replay_accepted(trace: RoundTrace, depth: int, total_tokens: int) -> int:
    """Draft tokens a tree of this depth and size would have accepted in the traced round (greedy)."""
    candidates = trace.candidates
    if candidates is None or total_tokens <= 1 or depth < 1:
        return 0
    tokens, parents = candidates.tokens.tolist(), candidates.parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for index in subtree_candidates(candidates, depth, total_tokens).tolist():
        children.setdefault(parents[index], {})[tokens[index]] = index
    node, accepted = -1, 0
    for token in trace.target_tokens:  # cut where the recorded target tokens end (a lower bound)
        node = children.get(node, {}).get(token)
        if node is None:
            break
        accepted += 1
    return accepted


def mean_draft_seconds(draft_seconds: dict[tuple[int, int], float], ranks: list[list[float] | None], depth: int,
                       top_k: int, total_tokens: int) -> float:
    """Mean drafting time per traced round (`ranks`: each round's `stopping_ranks`), stopping early as
    `draft_tree` does; `draft_seconds[(j, top_k)]` is a draft of `j` full levels."""
    depths = [drafted_depth(r, depth, total_tokens) for r in ranks]
    return sum(draft_seconds[(j, top_k)] if j else 0.0 for j in depths) / len(depths)


def mean_tokens_per_round(traces: list[RoundTrace], depth: int, total_tokens: int) -> float:
    return sum(replay_accepted(t, depth, total_tokens) + 1 for t in traces) / len(traces)


# ---- measurements ---------------------------------------------------------------------------------------------
def _interleaved_medians(calls: dict, repeats: int) -> dict:
    """`{key: median seconds of calls[key]()}`, timing every call once per pass over `repeats` passes (after a
    warm-up pass), so that a machine whose speed drifts slows every key alike."""
    times = {key: [] for key in calls}
    for repeat in range(repeats + 1):
        for key, fn in calls.items():
            start = time.perf_counter()
            fn()
            if repeat:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


@torch.no_grad()
def measure_verify_seconds(target, context_ids: torch.LongTensor, sizes, repeats: int = 5) -> dict[int, float]:
    """`{T: seconds}` of one target forward over `T` chain-shaped tree tokens on top of `context_ids` `[1, L]`."""
    from transformers import DynamicCache

    device = target.device
    context_ids = context_ids.to(device)
    past = context_ids.shape[1]
    cache = DynamicCache(config=target.config)
    target(input_ids=context_ids, cache=cache, use_cache=True, logits_to_keep=1)

    def verify_call(size):
        tree = DraftTree(
            tokens=context_ids[0, -size:].clone() if size <= past else context_ids[0, :1].repeat(size),
            parents=torch.arange(-1, size - 1, device=device),
            depths=torch.arange(size, device=device),
            visible=torch.ones(size, size, dtype=torch.bool, device=device).tril(),
        )

        def verify():
            target(input_ids=tree.tokens[None], position_ids=(past + tree.depths)[None],
                   attention_mask=tree_attention_mask(target, tree, past, device), cache=cache, use_cache=True,
                   output_hidden_states=-1)
            for layer in cache.layers:  # drop the tree again
                layer.crop(-size)
        return verify

    return _interleaved_medians({size: verify_call(size) for size in sizes}, repeats)


def _full_tree_tokens(depth: int, top_k: int) -> int:
    """Tokens a full tree of this depth and width sends to verification: its draft nodes plus the root."""
    return 1 + max_tree_nodes(depth, top_k)


@torch.no_grad()
def measure_draft_seconds(drafter, target, context_ids: torch.LongTensor, depths, top_ks,
                          repeats: int = 5) -> dict[tuple[int, int], float]:
    """`{(depth, top_k): seconds}` of `draft_tree` on a drafter session committed over `context_ids` `[1, L]`, with
    the drafter's own `int8_draft_weights`, as generate drafts."""
    session = DraftSession(drafter.bind(target))
    context_ids = context_ids.to(target.device)
    out = target(input_ids=context_ids[:, :-1], output_hidden_states=drafter.config.input_feature_layers,
                 logits_to_keep=1)
    session.commit(drafter.target_features(out.hidden_states)[0], context_ids[0, 1:])
    root = context_ids[0, -1]

    def draft_call(depth, top_k):
        def draft():
            draft_tree(session, root, depth, top_k, _full_tree_tokens(depth, top_k))
            session.end_round()
        return draft

    return _interleaved_medians({(d, k): draft_call(d, k) for k in top_ks for d in depths}, repeats)


@torch.no_grad()
def tune(target, drafter, prompts: list[torch.LongTensor], *, top_ks=(1, 2, 4, 8), max_depth: int = 8,
         totals=(2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), max_new_tokens: int = 64, repeats: int = 5,
         progress=None) -> TuneResult:
    """Calibrate on `prompts` (token ids `[1, L]` each) and rank every budget in the grid by predicted tokens/s.

    The drafter must be bound to `target`; its settings are left as they are (calibration passes views of it with
    other settings, `with_generation_config`). Calibration runs without the prompt-lookup branch, and the budget is
    chosen for the drafted tree; `measure_lookup` then times the branch with it.
    """
    log = progress or (lambda message: None)
    if not prompts:
        raise ValueError("tune needs at least one calibration prompt")
    # Each width is calibrated with its largest tree (root included); smaller budgets are replayed as cuts of it.
    calibrated_size = {k: min(max(totals), _full_tree_tokens(max_depth, k)) for k in top_ks}

    # Plain decoding and each width's calibration take turns on every prompt, so drift slows them alike.
    calibrating = {k: drafter.with_generation_config(
        draft_mode="tree", tree_depth=max_depth, tree_top_k=k, tree_total_tokens=calibrated_size[k],
        lookup_num_tokens=0, speculation="always") for k in top_ks}
    decode_tokens, decode_seconds = 0, 0.0
    traces: dict[int, list[RoundTrace]] = {k: [] for k in top_ks}
    round_seconds: dict[int, list[float]] = {k: [] for k in top_ks}
    for number, ids in enumerate(prompts, start=1):
        log(f"calibrating on prompt {number} of {len(prompts)}: plain decoding, then top_k {list(top_ks)} "
            f"(depth {max_depth}, {[calibrated_size[k] for k in top_ks]} tokens) ...")
        ids = ids.to(target.device)
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        decode_seconds += time.perf_counter() - start
        decode_tokens += out.shape[1] - ids.shape[1]
        for k in top_ks:
            with observe_rounds(traces[k].append), warnings.catch_warnings():
                warnings.simplefilter("ignore", UntunedDeviceWarning)  # calibration runs are the tuning itself
                stats = target.generate(ids, assistant_model=calibrating[k], max_new_tokens=max_new_tokens,
                                        do_sample=False, return_dict_in_generate=True).speculative_stats
            round_seconds[k].extend(
                sum(parts) for parts in zip(stats.draft_seconds, stats.verify_seconds, stats.bookkeeping_seconds))
    acceptance = {k: _position_acceptance(traces[k], max_depth, calibrated_size[k]) for k in top_ks}

    budgets = [(d, k, t) for k in top_ks for d in range(1, max_depth + 1)
               for t in sorted({min(t, _full_tree_tokens(d, k)) for t in totals if t >= 2})]
    context = max(prompts, key=lambda ids: ids.shape[1])
    sizes = sorted({t for _, _, t in budgets} | set(calibrated_size.values()))
    log(f"timing verification of {sizes} tokens ...")
    verify = measure_verify_seconds(target, context, sizes, repeats)
    log("timing drafting ...")
    draft = measure_draft_seconds(drafter, target, context, range(1, max_depth + 1), top_ks, repeats)
    ranks = {k: [None if t.candidates is None else stopping_ranks(t.candidates) for t in traces[k]] for k in top_ks}
    overhead = statistics.median(
        seconds - mean_draft_seconds(draft, [r], max_depth, k, calibrated_size[k]) - verify[calibrated_size[k]]
        for k in top_ks for seconds, r in zip(round_seconds[k], ranks[k])
    )
    overhead = max(overhead, 0.0)
    estimates = [
        BudgetEstimate(depth=d, top_k=k, total_tokens=t, tokens_per_round=mean_tokens_per_round(traces[k], d, t),
                       round_seconds=mean_draft_seconds(draft, ranks[k], d, k, t) + verify[t] + overhead)
        for d, k, t in budgets
    ]
    estimates.sort(key=lambda e: -e.tokens_per_second)
    return TuneResult(
        estimates=estimates, decode_seconds_per_token=decode_seconds / max(decode_tokens, 1), verify_seconds=verify,
        draft_seconds=draft, overhead_seconds=overhead, position_acceptance=acceptance,
        calibration={"prompts": len(prompts), "max_new_tokens": max_new_tokens,
                     "rounds": {str(k): len(v) for k, v in traces.items()}, "max_depth": max_depth},
    )


def _position_acceptance(traces: list[RoundTrace], depth: int, total_tokens: int) -> list[float]:
    from .metrics import position_acceptance

    return position_acceptance([replay_accepted(t, depth, total_tokens) for t in traces], depth)


def format_table(result: TuneResult, rows: int = 12) -> str:
    lines = ["| depth | top_k | total_tokens | tokens/round | round ms | tokens/s | predicted speedup |",
             "|---|---|---|---|---|---|---|"]
    for e in result.estimates[:rows]:
        lines.append(f"| {e.depth} | {e.top_k} | {e.total_tokens} | {e.tokens_per_round:.2f} | "
                     f"{e.round_seconds * 1e3:.1f} | {e.tokens_per_second:.2f} | {result.speedup(e):.2f}x |")
    return "\n".join(lines)


def format_costs(result: TuneResult) -> str:
    """The measured cost model: verification by tree size, drafting by depth and width, in decode steps too."""
    decode = result.decode_seconds_per_token
    verify = ", ".join(f"{n}: {s * 1e3:.0f} ms ({s / decode:.2f})" for n, s in result.verify_seconds.items())
    lines = [f"plain decoding: {decode * 1e3:.1f} ms/token; round overhead: {result.overhead_seconds * 1e3:.1f} ms",
             f"verify (tree tokens: ms (decode steps)): {verify}"]
    for k in sorted({k for _, k in result.draft_seconds}):
        draft = ", ".join(f"{d}: {s * 1e3:.0f}" for (d, kk), s in sorted(result.draft_seconds.items()) if kk == k)
        lines.append(f"draft top_k={k} (depth: ms): {draft}")
    for k, alphas in result.position_acceptance.items():
        lines.append(f"per-position acceptance, top_k={k}: " + " ".join(f"{a:.2f}" for a in alphas))
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _lengths(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if values and min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .assets import DTYPES

    parser.add_argument("drafter", help="drafter folder, or 'default' (= 'poss2') / 'single' for a shipped one")
    parser.add_argument("--target", default="default", help="'default', a model folder or a .gguf file")
    parser.add_argument("--prompts", required=True, help="calibration prompts: a .jsonl file, a folder or registry:NAME")
    parser.add_argument("--limit", type=int, default=2, help="questions per prompt set")
    parser.add_argument("--per-category", type=int, default=None, metavar="N",
                        help="the first N questions of each category of a prompt set, before --limit (as poss bench)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=_int_list, default=[1, 2, 4, 8], help="widths to calibrate (comma separated)")
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--totals", type=_int_list, default=[2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
                        help="tree sizes to consider, root included")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per micro-benchmark")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch-sizes", type=_int_list, default=None, metavar="B,B,...",
                        help="also measure left-padded batches of these sizes with the chosen budget (plain batched "
                             "generate against the drafter) and record the largest where speculation pays "
                             "(max_batch_size; needs as many calibration questions as the largest size)")
    parser.add_argument("--batch-max-new-tokens", type=int, default=64, help="new tokens per batch measurement")
    parser.add_argument("--lookup-tokens", type=_lengths, default=[0, 10], metavar="N,N,...",
                        help="prompt-lookup branch lengths to measure with the chosen budget (0: no branch); the "
                             "fastest goes into the entry (default: 0,10; '' skips the measurement and leaves the "
                             "drafter's own setting)")
    parser.add_argument("--int8-draft-weights", choices=("on", "off"), default=None,
                        help="tune drafting on 8-bit weight copies (CPU) or not (default: the drafter's own choice; "
                             "the shipped drafters have it on)")
    parser.add_argument("--output-dir", default=None,
                        help="save the tuned drafter here (default: rewrite the budget files of the drafter folder)")
    parser.add_argument("--dry-run", action="store_true", help="print the ranking, write nothing")
    return parser


def largest_paying_batch(speedups: dict[int, float]) -> int:
    """The largest measured batch size up to which every measured size ran faster with the drafter than plain
    batched `generate` (`{batch size: speedup}`); 0 when batch 1 (the smallest) did not."""
    paying = 0
    for size in sorted(speedups):
        if speedups[size] <= 1.0:
            break
        paying = size
    return paying


def measure_batches(target, tokenizer, drafter, questions, batch_sizes, max_new_tokens: int, progress=None):
    """`{batch size: speedup}` of `drafter` (its budget as it is, drafting at every size) over plain batched
    `generate` on left-padded batches of the questions' first turns (`evaluation.batching`)."""
    from .evaluation.batching import run_batch_benchmark

    always = drafter.with_generation_config(speculation="always")
    rows = run_batch_benchmark(target, tokenizer, questions, {"poss": always}, sorted(batch_sizes),
                               max_new_tokens=max_new_tokens, progress=progress)
    return {row["batch_size"]: row["speedup"] for row in rows if row["method"] == "poss"}


@torch.no_grad()
def measure_lookup(target, drafter, prompts: list[torch.LongTensor], lengths, max_new_tokens: int,
                   progress=None) -> dict[int, float]:
    """`{length: speedup}`: tokens/s of `generate` with `drafter` (its budget as it is) and a prompt-lookup branch of
    each `length` (0: none), over plain greedy `generate`, on `prompts` (token ids `[1, L]` each); after an untimed
    warm-up of each, every prompt runs plainly and with each length in turn, so drift slows them alike."""
    log = progress or (lambda message: None)
    views = {n: drafter.with_generation_config(lookup_num_tokens=n, speculation="always") for n in lengths}
    seconds = {n: 0.0 for n in ["plain", *lengths]}
    tokens = dict.fromkeys(seconds, 0)
    for n in seconds:  # warm-up, untimed: a view's first call builds what later calls reuse
        target.generate(prompts[0].to(target.device), max_new_tokens=8, do_sample=False,
                        **({} if n == "plain" else {"assistant_model": views[n]}))
    for number, ids in enumerate(prompts, start=1):
        log(f"timing the prompt-lookup branch {list(lengths)} on prompt {number} of {len(prompts)} ...")
        ids = ids.to(target.device)
        for n in seconds:
            extra = {} if n == "plain" else {"assistant_model": views[n]}
            start = time.perf_counter()
            out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
            seconds[n] += time.perf_counter() - start
            tokens[n] += out.shape[1] - ids.shape[1]
    plain = tokens["plain"] / seconds["plain"]
    return {n: tokens[n] / seconds[n] / plain for n in lengths}


def fastest_lookup(speedups: dict[int, float]) -> int:
    """The branch length with the highest measured speedup (`{length: speedup}`), the shorter one on a tie."""
    return max(speedups, key=lambda n: (speedups[n], -n))


def lookup_prompts(target, tokenizer, questions, max_new_tokens: int, use_chat_template: bool = True):
    """Token ids `[1, L]` of each question's first turn and, where it has a second, of that follow-up after the
    target's own greedy first answer (the turns where a lookup branch can copy from the conversation)."""
    from .evaluation.prompts import chat_prompt

    prompts = []
    for question in questions:
        first = tokenizer(chat_prompt(tokenizer, question.turns, [], use_chat_template), return_tensors="pt").input_ids
        prompts.append(first)
        if len(question.turns) > 1:
            out = target.generate(first.to(target.device), max_new_tokens=max_new_tokens, do_sample=False)
            answer = tokenizer.decode(out[0, first.shape[1]:], skip_special_tokens=True)
            text = chat_prompt(tokenizer, question.turns, [answer], use_chat_template)
            prompts.append(tokenizer(text, return_tensors="pt").input_ids)
    return prompts


def device_entry(result: TuneResult, batch_speedups: dict[int, float] | None,
                 lookup_speedups: dict[int, float] | None = None) -> dict:
    """The `device_budgets` entry a tuning run writes: the best budget, the prompt-lookup branch length that ran
    fastest where measured, and `max_batch_size` where measured (or 0 when no budget is predicted to beat plain
    decoding)."""
    best = result.best
    entry = {"tree_depth": best.depth, "tree_top_k": best.top_k, "tree_total_tokens": best.total_tokens}
    if lookup_speedups:
        entry["lookup_num_tokens"] = fastest_lookup(lookup_speedups)
    if batch_speedups:
        entry["max_batch_size"] = largest_paying_batch(batch_speedups)
    elif result.speedup(best) < 1:
        entry["max_batch_size"] = 0
    return entry


def merged_tuning_record(previous: dict, kind: str, record: dict) -> dict:
    """The drafter's tuning record with `record` as the entry of device kind `kind` (`{"device_kinds": {kind:
    record}}`), the other kinds' entries kept."""
    kinds = dict(previous.get("device_kinds") or {})
    kinds[kind] = record
    return {"device_kinds": kinds}


def _tune_inputs(args):
    """(drafter folder, prompt sets) of a `poss tune` call; `ValueError` before any work."""
    from pathlib import Path

    from .assets import DEFAULT_DRAFTERS, default_drafter_path
    from .evaluation.prompts import load_prompt_sets

    if args.max_depth < 1:
        raise ValueError("--max-depth must be >= 1")
    shipped = {"default": "poss2", **{name: name for name in DEFAULT_DRAFTERS}}
    folder = default_drafter_path(shipped[args.drafter]) if args.drafter in shipped else Path(args.drafter)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} holds no drafter (config.json missing)")
    try:
        prompt_sets = load_prompt_sets(args.prompts, limit=args.limit, per_category=args.per_category)
    except (FileNotFoundError, RuntimeError) as error:
        raise ValueError(str(error)) from None
    questions = sum(len(q) for q in prompt_sets.values())
    if args.batch_sizes and max(args.batch_sizes) > questions:
        raise ValueError(f"--batch-sizes up to {max(args.batch_sizes)} needs as many calibration questions; the "
                         f"prompts give {questions} (raise --limit)")
    return folder, prompt_sets


def run_tune(args) -> int:
    import json

    from .assets import load_drafter, load_target, runtime_options
    from .devices import device_kind
    from .evaluation.prompts import chat_prompt

    try:
        folder, prompt_sets = _tune_inputs(args)
    except ValueError as error:
        print(f"poss tune: error: {error}", file=sys.stderr)
        return 2
    device, dtype = runtime_options(args.threads, args.device, args.dtype)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    target, tokenizer = load_target(args.target, dtype, device)
    kind = device_kind(target.device, target.dtype)
    kernels = {} if args.int8_draft_weights is None else {"int8_draft_weights": args.int8_draft_weights == "on"}
    drafter = load_drafter(folder, **kernels)
    drafter.bind(target)  # checked against the target, moved beside its lm_head
    questions = [q for qs in prompt_sets.values() for q in qs]
    prompts = [tokenizer(chat_prompt(tokenizer, q.turns, []), return_tensors="pt").input_ids for q in questions]
    log(f"tuning for {kind} on {len(prompts)} calibration prompts from {sorted(prompt_sets)}")
    result = tune(target, drafter, prompts, top_ks=args.top_k, max_depth=args.max_depth, totals=args.totals,
                  max_new_tokens=args.max_new_tokens, repeats=args.repeats, progress=log)
    print(format_costs(result) + "\n")
    print(format_table(result))
    best = result.best
    print(f"\nplain decoding {result.decode_seconds_per_token * 1e3:.1f} ms/token; best budget depth {best.depth}, "
          f"top_k {best.top_k}, total_tokens {best.total_tokens}: predicted {result.speedup(best):.2f}x on {kind}")
    if result.speedup(best) < 1:
        print("note: no budget is predicted to beat plain decoding with this drafter on this device")
    budget = drafter.with_generation_config(tree_depth=best.depth, tree_top_k=best.top_k,
                                            tree_total_tokens=best.total_tokens)
    lookup_speedups = None
    if args.lookup_tokens:
        measured = lookup_prompts(target, tokenizer, questions, args.max_new_tokens)
        lookup_speedups = measure_lookup(target, budget, measured, args.lookup_tokens, args.max_new_tokens,
                                         progress=log)
        print("\nprompt-lookup branch with this budget (measured speedup): "
              + ", ".join(f"{n} tokens: {s:.2f}x" for n, s in lookup_speedups.items()))
        budget = budget.with_generation_config(lookup_num_tokens=fastest_lookup(lookup_speedups))
    batch_speedups = None
    if args.batch_sizes:
        batch_speedups = measure_batches(target, tokenizer, budget, questions, args.batch_sizes,
                                         args.batch_max_new_tokens, progress=log)
        print("\n" + ", ".join(f"batch {b}: {s:.2f}x" for b, s in sorted(batch_speedups.items())))
    entry = device_entry(result, batch_speedups, lookup_speedups)
    print(f"entry for {kind}: {json.dumps(entry)}")
    if args.dry_run:
        return 0
    record = result.record()
    record.update(device_kind=kind, entry=entry, command=typed_command(), int8_draft_weights=drafter.int8_draft_weights,
                  device=f"{device} ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads)")
    if lookup_speedups:
        record["lookup_speedups"] = {str(n): round(s, 3) for n, s in lookup_speedups.items()}
    if batch_speedups:
        record["batch_speedups"] = {str(b): round(s, 3) for b, s in sorted(batch_speedups.items())}
    settings = drafter.generation_config
    settings.device_budgets = {**settings.device_budgets, kind: entry}
    drafter.tuning_record = merged_tuning_record(drafter.tuning_record, kind, record)
    if args.output_dir:
        drafter.save_pretrained(args.output_dir)
        log(f"saved the tuned drafter to {args.output_dir}")
    else:  # the budget and its record only; weights, config.json and card untouched
        settings.save_pretrained(folder)
        (folder / "tuning_record.json").write_text(json.dumps(drafter.tuning_record, indent=2, sort_keys=True) + "\n",
                                                   encoding="utf-8")
        log(f"wrote the {kind} entry into {folder / 'generation_config.json'} and its record into tuning_record.json")
    return 0


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser("tune", help="choose the tree budget that is fastest on this device kind",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run_tune)
