"""Losslessness checks: token identity with plain greedy `generate`, and greedy consistency (DESIGN.md section 5).

Identity is a float32 property. In bfloat16 a forward over k tokens rounds differently from k one-token forwards, so
multi-token verification can flip near-ties; there the benchmark also checks *greedy consistency*: the target, run
once teacher-forced over the returned sequence, ranks every generated token within `tolerance` logits of its argmax.
"""

from __future__ import annotations

import torch

# Logit gap accepted as dtype noise (plain bf16 generate itself shows up to 0.25; fp32 shows 0).
CONSISTENCY_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}


def default_tolerance(dtype: torch.dtype) -> float:
    return CONSISTENCY_TOLERANCE.get(dtype, 0.25)


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


@torch.no_grad()
def greedy_consistency(target, sequence: torch.LongTensor, prompt_length: int, tolerance: float) -> dict:
    """Teacher-force `target` over `sequence` `[L]` and measure each generated token's gap to the argmax.

    Args:
        sequence: prompt followed by generated tokens, `[L]` (or `[1, L]`).
        prompt_length: tokens of `sequence` that are prompt.
        tolerance: largest logit gap counted as dtype noise.
    Returns:
        `{"consistent", "max_gap", "tokens_over" (how many gaps exceed tolerance), "first_over" (index into the
        generated tokens or None), "checked" (generated tokens checked)}`.
    """
    sequence = sequence.reshape(-1)
    generated = sequence.shape[0] - prompt_length
    if prompt_length < 1 or generated < 0:
        raise ValueError(f"prompt_length {prompt_length} does not fit a sequence of {sequence.shape[0]} tokens")
    if generated == 0:
        return {"consistent": True, "max_gap": 0.0, "tokens_over": 0, "first_over": None, "checked": 0}
    device = target.get_input_embeddings().weight.device
    ids = sequence[None].to(device)
    kwargs = {"logits_to_keep": generated + 1} if target._supports_logits_to_keep() else {}
    logits = target(input_ids=ids, use_cache=False, **kwargs).logits[0, -generated - 1 : -1].float()  # [n, V]
    chosen = logits.gather(-1, ids[0, prompt_length:, None]).squeeze(-1)
    gaps = logits.max(dim=-1).values - chosen
    over = (gaps > tolerance).nonzero().flatten()
    return {
        "consistent": over.numel() == 0,
        "max_gap": float(gaps.max()),
        "tokens_over": int(over.numel()),
        "first_over": int(over[0]) if over.numel() else None,
        "checked": generated,
    }
