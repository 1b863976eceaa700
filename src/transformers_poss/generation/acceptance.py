"""Acceptance rules: which root path of a verified draft tree the target keeps, and the token it adds after it.

Both rules read `processed[i]`, the target's processed logits `[V]` at tree node `i` (a `TreeLogits`, or an `[n, V]`
tensor), and return `(path, next_token)`: the accepted node indices from the root (0) down, and the target's own next
token (0-dim) after the path's last node.
"""

from __future__ import annotations

import torch

from .drafting import DraftTree


def choose(processed: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The target's next token (0-dim) from processed logits `[V]`: sampled, or the argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), 1)[0]
    return processed.argmax()


def accept(processed, tree: DraftTree, do_sample: bool) -> tuple[list[int], torch.Tensor]:
    """`accept_sampling` when sampling, else `accept_greedy`."""
    return (accept_sampling if do_sample else accept_greedy)(processed, tree)


def children(tree: DraftTree) -> list[list[int]]:
    """Each node's children, in node order."""
    found = [[] for _ in range(len(tree))]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            found[parent].append(node)
    return found


def accept_greedy(processed, tree: DraftTree) -> tuple[list[int], torch.Tensor]:
    """The longest root path whose every token is the target's argmax at its parent."""
    tokens, below = tree.tokens.tolist(), children(tree)
    path = [0]
    while True:
        node = path[-1]
        choice = processed[node].argmax()
        wanted = int(choice)
        child = next((c for c in below[node] if tokens[c] == wanted), None)
        if child is None:
            return path, choice
        path.append(child)


def accept_sampling(processed, tree: DraftTree) -> tuple[list[int], torch.Tensor]:
    """Multi-candidate rejection sampling for deterministic (top-k) drafts; keeps the target distribution.

    At a node with target distribution p, children's tokens t_1..t_m are tried in turn: t_i is accepted with
    probability p(t_i), else p(t_i) is set to 0 and p renormalised. If none is accepted the next token is sampled from
    what is left of p. Each token t is thus output with probability exactly p(t).
    """
    tokens, below = tree.tokens.tolist(), children(tree)
    path = [0]
    while True:
        node = path[-1]
        probs = torch.softmax(processed[node], dim=-1)
        accepted = None
        for child in below[node]:
            token = tokens[child]
            if torch.rand((), device=probs.device) < probs[token]:
                accepted = child
                break
            probs[token] = 0.0
            total = probs.sum()
            if total <= 0:
                break
            probs = probs / total
        if accepted is None:
            return path, torch.multinomial(probs, 1)[0]
        path.append(accepted)
