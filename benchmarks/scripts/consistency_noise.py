"""How far does a multi-token forward put plain `generate`'s own tokens from its argmax? (the bf16 tolerance)

    python benchmarks/scripts/consistency_noise.py                                   # the `poss demo` prompts, bf16
    python benchmarks/scripts/consistency_noise.py --prompts ../shared/data/specbench/mt_bench.jsonl --limit 8 --drafter default

For each prompt, plain greedy `generate` answers it; then the answer is read back by forwards of other shapes: one
teacher-forced forward over the whole answer (the check `poss demo` and `poss bench` used before), and forwards of
`--chunks` tokens at a time over a KV cache, the shape of a tree verification. Each prints the largest gap between
plain `generate`'s own token and that forward's argmax: rounding noise, since the answer is plain `generate`'s. The
greedy-consistency check (`transformers_poss.evaluation.greedy_consistency`, plain `generate`'s own computation)
must give 0 on it. With `--drafter`, the speculative answer's gaps under that check are printed too: 0 where it
takes plain `generate`'s choice, the margin plain `generate` had where it parts.
"""

import argparse
import json

import torch
from transformers import DynamicCache

from transformers_poss import assets
from transformers_poss.evaluation import greedy_consistency


def plain_gaps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`[n]` gaps `max(logits[i]) - logits[i, tokens[i]]` for logits `[n, V]` predicting `tokens` `[n]`."""
    logits = logits.float()
    return logits.max(-1).values - logits.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def chunked_logits(target, prompt: torch.Tensor, answer: torch.Tensor, chunk: int) -> torch.Tensor:
    """Logits `[n, V]` predicting each answer token: a prefill of the prompt, then `chunk` answer tokens per forward."""
    cache = DynamicCache(config=target.config)
    out = target(input_ids=prompt[None], cache=cache, use_cache=True)
    rows = [out.logits[0, -1:]]
    for start in range(0, answer.shape[0] - 1, chunk):
        piece = answer[start : min(start + chunk, answer.shape[0] - 1)]
        out = target(input_ids=piece[None], cache=cache, use_cache=True)
        rows.append(out.logits[0])
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default=None, help="a Spec-Bench style .jsonl (default: the demo's prompts)")
    parser.add_argument("--limit", type=int, default=8, help="questions of --prompts (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--chunks", default="4,8", help="verification-shaped forwards of these many tokens")
    parser.add_argument("--drafter", default=None, help="also check this drafter's answers ('default': shipped PosS-2)")
    parser.add_argument("--dtype", choices=tuple(assets.DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    device, dtype = assets.runtime_options(args.threads, "cpu", args.dtype)
    target, tokenizer = assets.load_default_target(dtype=dtype)
    if args.prompts:
        with open(args.prompts) as f:
            texts = [json.loads(line)["turns"][0] for line in f if line.strip()][: args.limit]
    else:
        texts = [conversation[0] for conversation in assets.DEMO_CONVERSATIONS]
    drafter = None
    if args.drafter:
        from transformers_poss import PosSDrafter

        path = assets.default_drafter_path("poss2") if args.drafter == "default" else args.drafter
        drafter = PosSDrafter.from_pretrained(path)
        drafter.bind(target)
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"dtype {args.dtype}, {args.max_new_tokens} new tokens; largest gap of plain generate's own tokens:")
    print("| prompt | tokens | whole-answer forward | " + " | ".join(f"{c}-token forwards" for c in chunks)
          + " | greedy_consistency" + (" | drafter: parts at | not argmax | max gap |" if drafter else " |"))
    worst = {}
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                    do_sample=False)[0]
        prompt, answer = plain[: ids.shape[1]], plain[ids.shape[1] :]
        with torch.no_grad():
            whole = target(input_ids=plain[None], use_cache=False).logits[0, ids.shape[1] - 1 : -1]
        row = {"whole": float(plain_gaps(whole, answer).max())}
        for c in chunks:
            row[f"{c}"] = float(plain_gaps(chunked_logits(target, prompt, answer, c), answer).max())
        row["check"] = greedy_consistency(target, plain, ids.shape[1], tolerance=0.0)["max_gap"]
        for key, value in row.items():
            worst[key] = max(worst.get(key, 0.0), value)
        line = (f"| {text[:40]!r} | {answer.shape[0]} | {row['whole']:.3f} | "
                + " | ".join(f"{row[str(c)]:.3f}" for c in chunks) + f" | {row['check']:.3f}")
        if drafter is not None:
            with torch.no_grad():
                spec = target.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter)[0]
            check = greedy_consistency(target, spec, ids.shape[1], tolerance=0.0, reference=answer)
            parted = next((i for i, (a, b) in enumerate(zip(answer.tolist(), spec[ids.shape[1]:].tolist())) if a != b),
                          None)
            line += f" | {'-' if parted is None else parted} | {check['not_argmax']} | {check['max_gap']:.3f}"
        print(line + " |", flush=True)
    print("| largest | | " + " | ".join(f"{worst[k]:.3f}" for k in ["whole"] + [str(c) for c in chunks])
          + f" | {worst['check']:.3f} |")


if __name__ == "__main__":
    main()
