"""Losslessness checks: token identity with plain greedy `generate`, and greedy consistency.

Identity is a float32 property. In bfloat16 a forward over k tokens rounds differently from k one-token forwards, so
a multi-token verification can rank a near-tie the other way than plain decoding does, and the answers part there.
*Greedy consistency* says whether that is all that happened: every token of an answer must be plain greedy
`generate`'s own choice given the answer's prefix, or lose to that choice by at most `tolerance` logits.

The reference is plain `generate`'s own computation (a prefill of the prompt, then one token per forward), not a
single teacher-forced forward over the whole answer: that forward is a multi-token forward too, so it rounds
differently from plain decoding and can put plain `generate`'s own tokens below its argmax in bf16. Measured against
plain decoding, plain `generate`'s own answer has a gap of exactly 0 at every token, by construction.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

# Largest logit gap counted as rounding noise: in bf16 one rounding step of logits near 20 above the largest gap a
# multi-token forward puts between plain `generate`'s own token and its argmax
# (`benchmarks/scripts/consistency_noise.py` measures it; docs/results.md, "Losslessness", has the figures); fp32
# forwards of different shapes differ far less.
CONSISTENCY_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.5}


def default_tolerance(dtype: torch.dtype) -> float:
    return CONSISTENCY_TOLERANCE.get(dtype, 0.5)


def compare_tokens(reference, candidate) -> dict:
    """Compare two generated token sequences `[n]`, `[m]` token for token.

    Returns `{"identical", "first_mismatch" (index or None), "matching_prefix", "reference_length",
    "candidate_length"}`; sequences of different length differ at the shorter one's end.
    """
    reference = [int(t) for t in reference]
    candidate = [int(t) for t in candidate]
    prefix = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        prefix += 1
    identical = prefix == len(reference) == len(candidate)
    return {
        "identical": identical,
        "first_mismatch": None if identical else prefix,
        "matching_prefix": prefix,
        "reference_length": len(reference),
        "candidate_length": len(candidate),
    }


class _ForceAndMeasure(LogitsProcessor):
    """Records each step's gap between greedy's choice and `tokens[step]`, then forces `tokens[step]`."""

    def __init__(self, tokens: torch.LongTensor):
        self.tokens = tokens
        self.gaps: list[float] = []

    def __call__(self, input_ids, scores):
        token = self.tokens[len(self.gaps)]
        row = scores[0].float()
        self.gaps.append(float(row.max() - row[token]))
        forced = torch.full_like(scores, float("-inf"))
        forced[0, token] = 0.0
        return forced


@torch.no_grad()
def greedy_consistency(target, sequence: torch.LongTensor, prompt_length: int, tolerance: float,
                       reference=None) -> dict:
    """How far each generated token of `sequence` is from plain greedy `generate`'s choice at the same prefix.

    Runs plain greedy `target.generate` on the prompt with every next token forced to `sequence`'s, and reads at each
    step the scores greedy decoding takes the argmax of (after `generate`'s logits processors): a token's gap is
    `max(scores) - scores[token]`. Wherever `sequence` takes plain `generate`'s choice the gap is 0; where it parts
    from it, the gap is the margin by which plain `generate` preferred its own token there. Costs one plain
    `generate` of the same length.

    Args:
        sequence: prompt followed by generated tokens, `[L]` (or `[1, L]`).
        prompt_length: tokens of `sequence` that are prompt.
        tolerance: largest gap counted as rounding noise (`default_tolerance(dtype)`).
        reference: plain greedy `generate`'s own generated tokens for this prompt, when at hand: a sequence equal to
            them is consistent with every gap 0 by construction, and the target is not run.
    Returns:
        `{"consistent", "max_gap", "tokens_over" (gaps above tolerance), "first_over" (index into the generated
        tokens or None), "not_argmax" (tokens scored below plain generate's choice, gap > 0), "checked" (generated
        tokens checked), "gaps" (per generated token)}`.
    """
    sequence = sequence.reshape(-1)
    generated = sequence.shape[0] - prompt_length
    if prompt_length < 1 or generated < 0:
        raise ValueError(f"prompt_length {prompt_length} does not fit a sequence of {sequence.shape[0]} tokens")
    new_tokens = sequence[prompt_length:]
    if generated == 0 or (reference is not None and compare_tokens(reference, new_tokens)["identical"]):
        return {"consistent": True, "max_gap": 0.0, "tokens_over": 0, "first_over": None, "not_argmax": 0,
                "checked": generated, "gaps": [0.0] * generated}
    device = target.get_input_embeddings().weight.device
    prompt = sequence[None, :prompt_length].to(device)
    measure = _ForceAndMeasure(new_tokens.to(device))
    # No end-of-sequence stop: a forced end token inside the sequence must not end the check early. Stopping does
    # not change any forward, so the scores stay plain generate's.
    target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=generated, min_new_tokens=None,
                    do_sample=False, eos_token_id=None, stop_strings=None, logits_processor=LogitsProcessorList([measure]))
    if len(measure.gaps) != generated:
        raise RuntimeError(f"the forced generate ran {len(measure.gaps)} steps for {generated} tokens")
    gaps = torch.tensor(measure.gaps)
    over = (gaps > tolerance).nonzero().flatten()
    return {
        "consistent": over.numel() == 0,
        "max_gap": float(gaps.max()),
        "tokens_over": int(over.numel()),
        "first_over": int(over[0]) if over.numel() else None,
        "not_argmax": int((gaps > 0).sum()),
        "checked": generated,
        "gaps": measure.gaps,
    }
