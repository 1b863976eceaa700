"""Run vLLM (CPU, fp32 by default, greedy, eager) on token-id prompts and write answers and spec-decode counters.

    python tests_vllm/run_vllm.py --target T --prompts ref.json --output out.json [--drafter DIR --k 3]
        [--schedule none|export]

`--prompts`: a JSON file with `prompts: [{prompt_ids: [...]}, ...]` (what `library_reference.py` writes). The output
has each prompt's answer ids, the spec-decode counters from `llm.get_metrics()` (drafts, draft tokens, accepted
tokens, accepted per position), alpha_p = per_pos[p] / per_pos[p - 1] (per_pos[0] / drafts for p = 1) and, for a
PosS drafter, how often each specialist ran (`specialist_calls`), and the engine's batch-size schedule (`schedule`:
`--schedule none` passes `num_speculative_tokens_per_batch_size: null`, drafting at every batch size; `export` leaves it
to the plugin, which applies the export's).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def spec_counters(metrics) -> dict:
    counters = {}
    for metric in metrics:
        name = metric.name.removeprefix("vllm:")
        if name.startswith("spec_decode"):
            counters[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return counters


def alphas(counters: dict) -> list[float]:
    drafts = counters.get("spec_decode_num_drafts", 0)
    per_pos = counters.get("spec_decode_num_accepted_tokens_per_pos", [])
    previous, out = drafts, []
    for count in per_pos:
        out.append(count / previous if previous else float("nan"))
        previous = count
    return out


def specialist_calls(worker) -> list[int] | None:
    """Run on vLLM's worker: how often each specialist of a poss_vllm drafter ran (None for other drafters)."""
    return getattr(worker.model_runner.drafter.model, "specialist_calls", None)


def engine_schedule(llm):
    """The engine's `num_speculative_tokens_per_batch_size` (None without speculation or schedule)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    speculative = getattr(config, "speculative_config", None)
    return getattr(speculative, "num_speculative_tokens_per_batch_size", None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--drafter", help="an export of `poss export --format vllm` (none: plain vLLM)")
    parser.add_argument("--method", default="eagle")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--schedule", choices=("none", "export"), default="none")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # specialist_calls travels to the worker
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if args.drafter:
        speculative = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.k}
        if args.schedule == "none":
            speculative["num_speculative_tokens_per_batch_size"] = None
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, speculative_config=speculative,
              max_model_len=4096, seed=0, disable_log_stats=False)
    prompts = json.load(open(args.prompts, encoding="utf-8"))["prompts"]
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p["prompt_ids"]) for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = spec_counters(llm.get_metrics())
    result = {"answers": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters,
              "alpha": alphas(counters), "seconds": seconds,
              "specialist_calls": llm.collective_rpc(specialist_calls)[0] if args.drafter else None,
              "schedule": engine_schedule(llm)}
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    print(json.dumps({"alpha": result["alpha"], "counters": counters, "seconds": round(seconds, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
