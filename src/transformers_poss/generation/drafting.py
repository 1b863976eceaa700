"""Drafting with position specialists: per-specialist KV caches, the EAGLE-2 dynamic tree, and a chain.

Positions. The target has processed tokens `x_0 .. x_{L-2}` and produced features `f_0 .. f_{L-2}`; `x_{L-1}` (the
*root*, last accepted token) is not yet through the target. Drafter position `i` holds the pair
`(x_{i+1}, f_i)`; the committed context is positions `0 .. S-1` with `S = L - 1`. Its output at `S - 1` predicts
`f_{L-1}`, whose logits give the tokens of draft level 1. A level-`d` node is fed back at drafter position
`S - 1 + d` with its parent's predicted feature.

Caches. The layer inputs `fc(...)` of the committed context are stored once. Specialist `s` keeps its own keys and
values (layer `s` of one `DynamicCache`), caught up lazily over the context the first time a round reaches it, then
the draft levels of the current round on top; `end_round` drops the draft levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..modeling_poss import PosSDrafter, additive_mask, cache_length


class DraftSession:
    """Drafter state across the rounds of one `generate` call (batch size 1)."""

    def __init__(self, drafter: PosSDrafter):
        self.drafter = drafter
        self.cache = DynamicCache()
        self.context_inputs: torch.Tensor | None = None  # [S, H] layer inputs of the committed context
        n = drafter.config.num_specialists
        self.context_cached = [0] * n  # context positions in each specialist's cache
        self.nodes_cached = [0] * n  # round nodes in each specialist's cache (after its context)
        self.context_features: list[torch.Tensor | None] = [None] * n  # each specialist's output at position S - 1
        self._reset_round()

    @property
    def context_length(self) -> int:
        return 0 if self.context_inputs is None else self.context_inputs.shape[0]

    def _reset_round(self) -> None:
        device, dtype = self.drafter.fc.weight.device, self.drafter.fc.weight.dtype
        hidden = self.drafter.config.hidden_size
        self.node_inputs = torch.empty(0, hidden, device=device, dtype=dtype)  # [N, H]
        self.node_positions = torch.empty(0, dtype=torch.long, device=device)  # [N]
        self.node_visible = torch.empty(0, 0, dtype=torch.bool, device=device)  # [N, N] ancestor-or-self

    @torch.no_grad()
    def commit(self, target_features: torch.Tensor, next_tokens: torch.LongTensor) -> None:
        """Append committed positions: target features `[n, nH]` of accepted tokens (`drafter.target_features`)
        and the tokens after them `[n]`."""
        features = self.drafter.fuse_features(target_features[None])
        inputs = self.drafter.project(next_tokens[None], features)[0]
        self.context_inputs = inputs if self.context_inputs is None else torch.cat((self.context_inputs, inputs))

    def end_round(self) -> None:
        """Drop this round's draft levels from every specialist cache."""
        for s, cached in enumerate(self.nodes_cached):
            if cached:
                self.cache.layers[s].crop(-cached)
        self.nodes_cached = [0] * len(self.nodes_cached)
        self._reset_round()

    def add_nodes(self, inputs: torch.Tensor, positions: torch.LongTensor, parent_nodes: torch.LongTensor) -> None:
        """Feed round nodes: layer inputs `[n, H]`, positions `[n]`, parent node index `[n]` (-1: the root)."""
        n_old, n_new = self.node_positions.shape[0], positions.shape[0]
        visible = torch.zeros(n_old + n_new, n_old + n_new, dtype=torch.bool, device=inputs.device)
        visible[:n_old, :n_old] = self.node_visible
        has_parent = parent_nodes >= 0
        rows = torch.arange(n_old, n_old + n_new, device=inputs.device)
        visible[rows[has_parent], :n_old] = self.node_visible[parent_nodes[has_parent]]
        visible[rows, rows] = True
        self.node_visible = visible
        self.node_inputs = torch.cat((self.node_inputs, inputs))
        self.node_positions = torch.cat((self.node_positions, positions))

    @torch.no_grad()
    def run(self, specialist: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring `specialist` up to date over the context and round nodes.

        Returns:
            (feature predicted at the last context position `[H]`, predicted features of the round nodes it had not
            yet run `[n_new_nodes, H]`).
        """
        S, N = self.context_length, self.node_positions.shape[0]
        c, r = self.context_cached[specialist], self.nodes_cached[specialist]
        assert r == 0 or c == S, "a specialist's round nodes must sit on a complete context"
        device = self.context_inputs.device
        queries = torch.cat((self.context_inputs[c:S], self.node_inputs[r:N]))
        positions = torch.cat((torch.arange(c, S, device=device), self.node_positions[r:N]))
        n_ctx = S - c
        if queries.shape[0] == 0:  # already up to date (a second draft on the same context)
            return self.context_features[specialist], queries
        allowed = torch.zeros(queries.shape[0], S + N, dtype=torch.bool, device=device)
        keys = torch.arange(S, device=device)
        allowed[:n_ctx, :S] = keys[None, :] <= torch.arange(c, S, device=device)[:, None]
        allowed[n_ctx:, :S] = True
        allowed[n_ctx:, S:] = self.node_visible[r:N]
        assert cache_length(self.cache, specialist) == c + r
        out = self.drafter.run_specialist(
            specialist, queries[None], positions[None], additive_mask(allowed, queries.dtype), self.cache
        )[0]
        self.context_cached[specialist], self.nodes_cached[specialist] = S, N
        if n_ctx:
            self.context_features[specialist] = out[n_ctx - 1]
        return self.context_features[specialist], out[n_ctx:]


@dataclass
class DraftCandidates:
    """Every node a tree draft scored, in creation order (depth by depth), before the `total_tokens` cut.

    Attributes:
        tokens: `[C]` target token ids.
        parents: `[C]` parent candidate index (-1: the root).
        depths: `[C]` depth (1-based).
        scores: `[C]` cumulative draft log-probability (the ranking key).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    scores: torch.Tensor


@dataclass
class DraftTree:
    """A draft tree, root first, parents before children.

    Attributes:
        tokens: `[n]` target token ids; `tokens[0]` is the root (the last accepted token). Drafted nodes come
            depth by depth; a grafted lookup branch (`graft_branch`) follows them; parents always precede children.
        parents: `[n]` parent index (-1 for the root).
        depths: `[n]` depth (0 for the root).
        visible: `[n, n]` bool, `visible[i, j]` = node j is an ancestor of i or i itself (the tree attention mask).
        candidates: all scored candidates the tree was cut from (None for a root-only tree).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    visible: torch.Tensor
    candidates: DraftCandidates | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]


def _log_probs(drafter: PosSDrafter, features: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(drafter.logits(features).float(), dim=-1)


@torch.no_grad()
def draft_tree(session: DraftSession, root_token: torch.LongTensor, depth: int, top_k: int, total_tokens: int) -> DraftTree:
    """EAGLE-2 dynamic tree with position specialists.

    Depth 1 expands the root's top-k; each later depth feeds the `top_k` best frontier nodes through the specialist
    of that position, takes each node's top-k by cumulative log-probability and keeps the best `top_k` of `top_k^2`
    as the next frontier. All scored candidates are reranked; the best `total_tokens - 1` (closed under ancestors,
    since a child never scores above its parent) form the tree with the root.
    """
    drafter, config = session.drafter, session.drafter.config
    device = root_token.device
    budget = min(total_tokens - 1, max_tree_nodes(depth, top_k))
    if budget <= 0 or depth <= 0:
        return _make_tree(root_token, [], [], [], device)

    root_feature, _ = session.run(config.specialist_for_position(1))
    log_probs = _log_probs(drafter, root_feature)  # [V']
    k = min(top_k, log_probs.shape[-1])
    scores, draft_ids = log_probs.topk(k)
    # Candidates (every scored node): token, cumulative score, parent candidate (-1 root), depth.
    cand_tokens, cand_scores = [drafter.to_target_ids(draft_ids)], [scores]
    cand_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    cand_depths = [torch.ones(k, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device)  # candidate indices
    frontier_features = root_feature.expand(k, -1)
    frontier_parent_nodes = torch.full((k,), -1, dtype=torch.long, device=device)  # fed-node index of parent
    n_candidates = k
    all_tokens = cand_tokens[0]
    all_scores = cand_scores[0]
    for d in range(2, depth + 1):
        first_node = session.node_positions.shape[0]
        inputs = drafter.project(all_tokens[frontier][None], frontier_features[None])[0]
        positions = torch.full((frontier.shape[0],), session.context_length + d - 2, dtype=torch.long, device=device)
        session.add_nodes(inputs, positions, frontier_parent_nodes)
        _, node_features = session.run(config.specialist_for_position(d))
        node_features = node_features[-frontier.shape[0]:]
        log_probs = _log_probs(drafter, node_features)  # [F, V']
        k_child = min(top_k, log_probs.shape[-1])
        child_scores, child_ids = log_probs.topk(k_child, dim=-1)  # [F, k]
        cumulative = (all_scores[frontier][:, None] + child_scores).reshape(-1)
        parents = frontier.repeat_interleave(k_child)
        cand_tokens.append(drafter.to_target_ids(child_ids.reshape(-1)))
        cand_scores.append(cumulative)
        cand_parents.append(parents)
        cand_depths.append(torch.full_like(parents, d))
        new_indices = torch.arange(n_candidates, n_candidates + cumulative.shape[0], device=device)
        n_candidates += cumulative.shape[0]
        all_tokens = torch.cat(cand_tokens)
        all_scores = torch.cat(cand_scores)
        if d == depth:
            break
        keep = cumulative.topk(min(top_k, cumulative.shape[0])).indices
        frontier = new_indices[keep]
        frontier_features = node_features[keep // k_child]
        frontier_parent_nodes = first_node + keep // k_child

    parents_all = torch.cat(cand_parents)
    depths_all = torch.cat(cand_depths)
    chosen = select_candidates(all_scores, budget)
    tree = _make_tree(root_token, all_tokens[chosen], parents_all[chosen], depths_all[chosen], device, chosen)
    tree.candidates = DraftCandidates(all_tokens, parents_all, depths_all, all_scores)
    return tree


def select_candidates(scores: torch.Tensor, budget: int) -> torch.LongTensor:
    """Indices of the `budget` best candidates by score `[C]`, in creation order (ties keep creation order)."""
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    return torch.sort(order).values


def max_tree_nodes(depth: int, top_k: int) -> int:
    """Most draft nodes (root excluded) a tree of this depth and width can hold: top_k + (depth - 1) * top_k^2."""
    return top_k + max(depth - 1, 0) * top_k * top_k


def _make_tree(root_token, tokens, cand_parents, depths, device, chosen=None) -> DraftTree:
    """Assemble a `DraftTree` from chosen candidates (their parent indices refer to candidate numbering)."""
    n = 1 + (len(tokens) if chosen is not None else 0)
    root = root_token.reshape(1).to(device)
    if n == 1:
        return DraftTree(root, torch.tensor([-1], device=device), torch.zeros(1, dtype=torch.long, device=device),
                         torch.ones(1, 1, dtype=torch.bool, device=device))
    # Remap candidate parent ids to tree indices (root = 0, chosen[i] -> i + 1).
    remap = torch.full((int(chosen.max()) + 2,), -1, dtype=torch.long, device=device)
    remap[chosen] = torch.arange(1, n, device=device)
    parents = torch.where(cand_parents >= 0, remap[cand_parents.clamp(min=0)], torch.zeros_like(cand_parents))
    parents = torch.cat((torch.tensor([-1], device=device), parents))
    visible = torch.zeros(n, n, dtype=torch.bool, device=device)
    visible[0, 0] = True
    parent_list = parents.tolist()
    for i in range(1, n):  # parents come first, so their rows are complete
        visible[i] = visible[parent_list[i]]
        visible[i, i] = True
    return DraftTree(torch.cat((root, tokens)), parents,
                     torch.cat((torch.zeros(1, dtype=torch.long, device=device), depths)), visible)


LOOKUP_MIN_NGRAM = 2


def lookup_continuation(sequence: torch.LongTensor, max_ngram: int, num_tokens: int) -> torch.LongTensor:
    """Prompt lookup: what followed the latest earlier occurrence of the sequence's last `n` tokens.

    Tries `n = max_ngram` down to `LOOKUP_MIN_NGRAM`; longer matches win. `sequence` is `[L]`; returns up to
    `num_tokens` token ids `[m]` (`m = 0` when nothing matches).
    """
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), LOOKUP_MIN_NGRAM - 1, -1):
        windows = sequence[: length - 1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a next token
        starts = (windows == sequence[-n:]).all(dim=1).nonzero()
        if starts.numel():
            begin = int(starts[-1]) + n
            return sequence[begin : begin + num_tokens]
    return sequence[:0]


def graft_branch(tree: DraftTree, tokens: torch.LongTensor) -> DraftTree:
    """`tree` with `tokens` `[m]` as a root path: existing nodes are followed while they match, the rest appended.

    Siblings keep distinct tokens, so acceptance (greedy or rejection sampling) treats the grafted nodes as any
    other candidate. The appended nodes come after every drafted node; `tree.candidates` is kept as drafted.
    """
    token_list, parent_list = tree.tokens.tolist(), tree.parents.tolist()
    node, matched = 0, 0
    for token in tokens.tolist():
        child = next((c for c in range(node + 1, len(token_list)) if parent_list[c] == node and token_list[c] == token),
                     None)
        if child is None:
            break
        node, matched = child, matched + 1
    new_tokens = tokens[matched:].to(tree.tokens.device)
    m, n = new_tokens.shape[0], len(tree)
    if m == 0:
        return tree
    # Appended node n + i hangs below n + i - 1; the first one below the graft point.
    parents = torch.cat((tree.parents, torch.arange(n - 1, n + m - 1, device=tree.parents.device)))
    parents[n] = node
    depths = torch.cat((tree.depths, tree.depths[node] + torch.arange(1, m + 1, device=tree.depths.device)))
    visible = torch.zeros(n + m, n + m, dtype=torch.bool, device=tree.visible.device)
    visible[:n, :n] = tree.visible
    visible[n:, :n] = tree.visible[node]  # the graft point's ancestors and itself
    visible[n:, n:] = torch.ones(m, m, dtype=torch.bool, device=tree.visible.device).tril()
    return DraftTree(torch.cat((tree.tokens, new_tokens)), parents, depths, visible, tree.candidates)


@torch.no_grad()
def draft_chain(session: DraftSession, depth: int, pick) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Draft `depth` tokens along one path.

    Args:
        pick: `pick(level, draft_logits [V']) -> (draft index (0-dim long), processed target-vocab logits [V])`,
            choosing the token (top-1 or sampled) and returning the distribution it was chosen from.
    Returns:
        (target token ids, one 0-dim tensor per level; processed logits `[V]` per level).
    """
    drafter, config = session.drafter, session.drafter.config
    tokens, logits = [], []
    feature, _ = session.run(config.specialist_for_position(1))
    for level in range(1, depth + 1):
        draft_index, processed = pick(level, drafter.logits(feature).float())
        token = drafter.to_target_ids(draft_index)
        tokens.append(token)
        logits.append(processed)
        if level == depth:
            break
        inputs = drafter.project(token.reshape(1, 1), feature.reshape(1, 1, -1))[0]
        position = torch.tensor([session.context_length + level - 1], device=inputs.device)
        parent = torch.tensor([level - 2], device=inputs.device)  # previous chain node (-1 = root for level 1)
        session.add_nodes(inputs, position, parent)
        _, feature = session.run(config.specialist_for_position(level + 1))
        feature = feature[-1]
    return tokens, logits
