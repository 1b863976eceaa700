"""Fit a drafter briefly (teacher forcing) on a target's own greedy sequences: a drafter that really accepts, in
seconds, for tests of real targets (tiny_models.fitted_drafter does the same for tiny random targets)."""

from __future__ import annotations

import torch


def fit_drafter_to_sequences(target, drafter, sequences, prompt_lengths=None, steps: int = 40, lr: float = 3e-3,
                             seed: int = 0):
    """Train `drafter` in place on `sequences` (`[1, L]` each) and return it in eval mode.

    Every specialist is trained at every step on the teacher-forced inputs `(x_{i+1}, f_i)`: features regression
    (SmoothL1) plus cross-entropy of its logits against the target's argmax after `x_{i+1}`. With `prompt_lengths`
    the loss covers only positions that predict generated tokens (cheaper; the prompt is still attended to).
    """
    torch.manual_seed(seed)
    frozen = [(p, p.requires_grad) for p in target.parameters()]
    for param, _ in frozen:
        param.requires_grad_(False)
    data = []
    with torch.no_grad():
        for index, seq in enumerate(sequences):
            out = target(seq, output_hidden_states=-1)
            start = 0 if prompt_lengths is None else max(prompt_lengths[index] - 2, 0)
            data.append((seq, out.hidden_states[-1].float(), out.logits.argmax(-1), start))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    bound = drafter.bind(target, move=False)
    drafter.train()
    try:
        for step in range(steps):
            seq, features, target_next, start = data[step % len(data)]
            loss = 0.0
            for specialist in range(drafter.config.num_specialists):
                pred = bound(seq[:, 1:], features[:, :-1].to(drafter.dtype), specialist=specialist)
                kept = pred.features[0, start:]
                logits = bound.logits(kept).float()
                # position i holds (x_{i+1}, f_i): its prediction names the target's choice after x_{i+1}
                loss = loss + torch.nn.functional.cross_entropy(logits, target_next[0, 1 + start:])
                loss = loss + torch.nn.functional.smooth_l1_loss(kept.float(), features[0, 1 + start:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        for param, flag in frozen:
            param.requires_grad_(flag)
    return drafter.eval()
