"""Drafting with position specialists: per-specialist KV caches, the EAGLE-2 dynamic tree, and a chain.

Positions. The target has processed tokens `x_0 .. x_{L-2}` and produced features `f_0 .. f_{L-2}`; `x_{L-1}` (the
*root*, last accepted token) is not yet through the target. Drafter position `i` holds the pair
`(x_{i+1}, f_i)`; the committed context is positions `0 .. S-1` with `S = L - 1`. Its output at `S - 1` predicts
`f_{L-1}`, whose logits give the tokens of draft level 1. A level-`d` node is fed back at drafter position
`S - 1 + d` with its parent's predicted feature.

Caches. The layer inputs `fc(...)` of the committed context are stored once. Specialist `s` keeps its own keys and
values (layer `s` of a `DraftKVCache`), caught up lazily over the context the first time a round reaches it, then
the draft levels of the current round on top; `end_round` drops the draft levels.

Cost. A draft round works in buffers that grow only when a call needs more room: the context's layer inputs, each
specialist's keys and values (written in place, never concatenated), the round's node inputs, positions and
node-to-node attention mask, and the scored candidates. Shapes per depth are static (the frontier is always
`min(top_k, draft vocabulary)` wide) and nothing is read back to the host until the tree is assembled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..modeling_poss import PosSDrafter, additive_mask


def _grown(buffer: torch.Tensor | None, rows: int, like: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`buffer` if it holds at least `rows` along `dim`, else a buffer twice that size (shaped like `like` elsewhere)
    with the old contents copied."""
    if buffer is not None and buffer.shape[dim] >= rows:
        return buffer
    shape = list(like.shape)
    shape[dim] = max(2 * rows, 16)
    grown = like.new_empty(shape)
    if buffer is not None:
        grown.narrow(dim, 0, buffer.shape[dim]).copy_(buffer)
    return grown


class DraftKVCache:
    """Keys and values of the drafter's specialists, one layer each, written in place into growing buffers.

    It speaks the one cache method transformers' attention layers call, `update(keys, values, layer_idx)`, with
    `keys`/`values` `[1, H_kv, q, D]`, and returns the layer's keys/values so far `[1, H_kv, length, D]` (views).
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        start, end = self.lengths[layer_idx], self.lengths[layer_idx] + key_states.shape[-2]
        self.keys[layer_idx] = keys = _grown(self.keys[layer_idx], end, key_states, dim=-2)
        self.values[layer_idx] = values = _grown(self.values[layer_idx], end, value_states, dim=-2)
        keys[..., start:end, :].copy_(key_states)
        values[..., start:end, :].copy_(value_states)
        self.lengths[layer_idx] = end
        return keys[..., :end, :], values[..., :end, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def crop_layer(self, layer_idx: int, length: int) -> None:
        self.lengths[layer_idx] = length


class DraftSession:
    """Drafter state across the rounds of one `generate` call (batch size 1)."""

    def __init__(self, drafter: PosSDrafter):
        self.drafter = drafter
        n = drafter.config.num_specialists
        self.cache = DraftKVCache(n)
        self.context_length = 0  # S: committed positions
        self._context_inputs: torch.Tensor | None = None  # [>= S, layer_input_size] inputs of the committed context
        self.context_cached = [0] * n  # context positions in each specialist's cache
        self.nodes_cached = [0] * n  # round nodes in each specialist's cache (after its context)
        self.context_features: list[torch.Tensor | None] = [None] * n  # each specialist's output at position S - 1
        self.node_count = 0  # N: round nodes fed so far
        self._node_inputs: torch.Tensor | None = None  # [>= N, layer_input_size]
        self._node_positions: torch.Tensor | None = None  # [>= N]
        # Additive node-to-node mask [>= N + 1, >= N]: row i attends to its ancestors and itself (0), nothing else
        # (-inf); the last row stays all -inf, the row of the root's children's "parent".
        self._node_mask: torch.Tensor | None = None
        self._diagonal: torch.Tensor | None = None  # arange of the node capacity

    @property
    def context_inputs(self) -> torch.Tensor:
        """Layer inputs of the committed context `[S, layer_input_size]`."""
        return self._context_inputs[: self.context_length]

    @property
    def node_inputs(self) -> torch.Tensor:
        """Layer inputs of this round's fed nodes `[N, layer_input_size]`."""
        return self._node_inputs[: self.node_count]

    @property
    def node_positions(self) -> torch.LongTensor:
        """Drafter positions of this round's fed nodes `[N]`."""
        return self._node_positions[: self.node_count]

    @torch.no_grad()
    def commit(self, target_features: torch.Tensor, next_tokens: torch.LongTensor) -> None:
        """Append committed positions: target features `[n, nH]` of accepted tokens (`drafter.target_features`)
        and the tokens after them `[n]`."""
        features = self.drafter.fuse_features(target_features[None])
        inputs = self.drafter.project(next_tokens[None], features)[0]
        end = self.context_length + inputs.shape[0]
        self._context_inputs = _grown(self._context_inputs, end, inputs)
        self._context_inputs[self.context_length : end] = inputs
        self.context_length = end

    def begin_round(self, max_nodes: int) -> None:
        """Make room for up to `max_nodes` fed nodes this round (buffers grow only when a round needs more)."""
        if self._node_inputs is not None and self._node_inputs.shape[0] >= max_nodes:
            return
        weight = self.drafter.fc.weight
        capacity = max(max_nodes, 8)
        self._node_inputs = weight.new_empty(capacity, self.drafter.layer_input_size)
        self._node_positions = torch.empty(capacity, dtype=torch.long, device=weight.device)
        self._node_mask = torch.full((capacity + 1, capacity), torch.finfo(weight.dtype).min, dtype=weight.dtype,
                                     device=weight.device)
        self._diagonal = torch.arange(capacity, device=weight.device)

    def end_round(self) -> None:
        """Drop this round's draft levels from every specialist cache."""
        for s, cached in enumerate(self.nodes_cached):
            if cached:
                self.cache.crop_layer(s, self.context_cached[s])
        self.nodes_cached = [0] * len(self.nodes_cached)
        self.node_count = 0

    def add_nodes(self, inputs: torch.Tensor, position: int, parent_nodes: torch.LongTensor) -> int:
        """Feed round nodes: layer inputs `[n, layer_input_size]`, all at drafter `position`, parent node index
        `[n]` (-1: the root). Returns the index of the first new node."""
        first, n = self.node_count, inputs.shape[0]
        if self._node_inputs is None or first + n > self._node_inputs.shape[0]:
            raise RuntimeError("DraftSession.begin_round must reserve room for the round's nodes")
        rows = self._diagonal[first : first + n]
        self._node_inputs[first : first + n] = inputs
        self._node_positions[first : first + n] = position
        parent_rows = torch.where(parent_nodes >= 0, parent_nodes, self._node_mask.shape[0] - 1)
        self._node_mask[first : first + n] = self._node_mask[parent_rows]
        self._node_mask[rows, rows] = 0
        self.node_count = first + n
        return first

    @torch.no_grad()
    def run(self, specialist: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring `specialist` up to date over the context and round nodes.

        Returns:
            (feature predicted at the last context position `[H]`, predicted features of the round nodes it had not
            yet run `[n_new_nodes, H]`).
        """
        S, N = self.context_length, self.node_count
        c, r = self.context_cached[specialist], self.nodes_cached[specialist]
        if c == S and r == N:  # already up to date (a second draft on the same context)
            return self.context_features[specialist], self._context_inputs[:0]
        node_mask = self._node_mask[r:N, :N] if N else None
        if c == S:  # the common case: only this round's new nodes
            queries, positions = self._node_inputs[r:N], self._node_positions[r:N]
            mask = F.pad(node_mask, (S, 0))
        else:  # catch up over new context positions (then every node of the round: its cache has none yet)
            assert r == 0, "a specialist's round nodes must sit on a complete context"
            device = self._context_inputs.device
            context_positions = torch.arange(c, S, device=device)
            queries, positions = self._context_inputs[c:S], context_positions
            causal = additive_mask(torch.arange(S, device=device)[None, :] <= context_positions[:, None],
                                   queries.dtype)[0, 0]
            mask = F.pad(causal, (0, N), value=torch.finfo(queries.dtype).min)
            if N:
                queries = torch.cat((queries, self._node_inputs[:N]))
                positions = torch.cat((positions, self._node_positions[:N]))
                mask = torch.cat((mask, F.pad(node_mask, (S, 0))))
        assert self.cache.get_seq_length(specialist) == c + r
        out = self.drafter.run_specialist(specialist, queries[None], positions[None], mask[None, None], self.cache)[0]
        n_ctx = S - c
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


def _log_probs(drafter: PosSDrafter, features: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    return torch.log_softmax(drafter.logits(features, vocab).float(), dim=-1)


@torch.no_grad()
def draft_tree(session: DraftSession, root_token: torch.LongTensor, depth: int, top_k: int,
               total_tokens: int, deep_vocab: int | None = None) -> DraftTree:
    """EAGLE-2 dynamic tree with position specialists.

    Depth 1 expands the root's top-k; each later depth feeds the `top_k` best frontier nodes through the specialist
    of that position, takes each node's top-k by cumulative log-probability (over the first `deep_vocab` draft
    tokens when given) and keeps the best `top_k` of `top_k^2` as the next frontier. All scored candidates are reranked; the best `total_tokens - 1` (closed under ancestors,
    since a child never scores above its parent) form the tree with the root.
    """
    drafter, config = session.drafter, session.drafter.config
    device = root_token.device
    budget = min(total_tokens - 1, max_tree_nodes(depth, top_k))
    if budget <= 0 or depth <= 0:
        return _make_tree(root_token, device)

    root_feature, _ = session.run(config.specialist_for_position(1))
    log_probs = _log_probs(drafter, root_feature)  # [V']
    k = min(top_k, log_probs.shape[-1])  # the frontier's width at every depth
    session.begin_round((depth - 1) * k)
    capacity = k + (depth - 1) * k * k
    cand_tokens = torch.empty(capacity, dtype=torch.long, device=device)
    cand_parents = torch.empty(capacity, dtype=torch.long, device=device)
    cand_depths = torch.empty(capacity, dtype=torch.long, device=device)
    cand_scores = torch.empty(capacity, dtype=torch.float32, device=device)
    scores, draft_ids = log_probs.topk(k)
    cand_tokens[:k] = drafter.to_target_ids(draft_ids)
    cand_scores[:k] = scores
    cand_parents[:k] = -1
    cand_depths[:k] = 1
    frontier = torch.arange(k, device=device)  # candidate indices
    frontier_scores, frontier_tokens = scores, cand_tokens[:k]
    frontier_features = root_feature.expand(k, -1)
    frontier_nodes = torch.full((k,), -1, dtype=torch.long, device=device)  # fed-node index of each one's parent
    count = k
    for d in range(2, depth + 1):
        inputs = drafter.project(frontier_tokens[None], frontier_features[None])[0]
        first = session.add_nodes(inputs, session.context_length + d - 2, frontier_nodes)
        _, node_features = session.run(config.specialist_for_position(d))
        node_features = node_features[-k:]
        child_scores, child_ids = _log_probs(drafter, node_features, deep_vocab).topk(k, dim=-1)  # [k, k]
        cumulative = (frontier_scores[:, None] + child_scores).reshape(-1)
        new = slice(count, count + k * k)
        cand_tokens[new] = drafter.to_target_ids(child_ids.reshape(-1))
        cand_scores[new] = cumulative
        cand_parents[new] = frontier.repeat_interleave(k)
        cand_depths[new] = d
        if d < depth:
            frontier_scores, keep = cumulative.topk(k)
            frontier = count + keep
            frontier_tokens = cand_tokens[frontier]
            parent_of_kept = keep // k
            frontier_features = node_features[parent_of_kept]
            frontier_nodes = first + parent_of_kept
        count += k * k

    candidates = DraftCandidates(cand_tokens[:count], cand_parents[:count], cand_depths[:count], cand_scores[:count])
    chosen = select_candidates(candidates.scores, budget)
    return _make_tree(root_token, device, candidates, chosen, depth)


def select_candidates(scores: torch.Tensor, budget: int) -> torch.LongTensor:
    """Indices of the `budget` best candidates by score `[C]`, in creation order (ties keep creation order)."""
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    return torch.sort(order).values


def max_tree_nodes(depth: int, top_k: int) -> int:
    """Most draft nodes (root excluded) a tree of this depth and width can hold: top_k + (depth - 1) * top_k^2."""
    return top_k + max(depth - 1, 0) * top_k * top_k


def _make_tree(root_token, device, candidates: DraftCandidates | None = None, chosen=None, depth: int = 0) -> DraftTree:
    """A `DraftTree` of the root and the `chosen` candidates `[n - 1]` (closed under ancestors, in creation order)
    of at most `depth` levels."""
    root = root_token.reshape(1).to(device)
    if candidates is None:
        return DraftTree(root, torch.tensor([-1], device=device), torch.zeros(1, dtype=torch.long, device=device),
                         torch.ones(1, 1, dtype=torch.bool, device=device))
    n = 1 + chosen.shape[0]
    nodes = torch.arange(n, device=device)
    # Candidate parent ids -> tree indices (root 0, chosen[i] -> i + 1); the root's children get 0.
    remap = torch.zeros(candidates.tokens.shape[0] + 1, dtype=torch.long, device=device)
    remap[chosen + 1] = nodes[1:]
    parents = torch.cat((nodes[:1] - 1, remap[candidates.parents[chosen] + 1]))
    # Ancestor-or-self by pointer jumping: `level` walks one parent up per step (the root points to itself).
    step = parents.clamp(min=0)
    visible = torch.zeros(n, n, dtype=torch.bool, device=device)
    level = nodes
    for _ in range(depth + 1):
        visible[nodes, level] = True
        level = step[level]
    depths = torch.cat((torch.zeros(1, dtype=torch.long, device=device), candidates.depths[chosen]))
    return DraftTree(torch.cat((root, candidates.tokens[chosen])), parents, depths, visible, candidates)


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
def draft_chain(session: DraftSession, depth: int, pick,
                deep_vocab: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Draft `depth` tokens along one path.

    Args:
        pick: `pick(level, draft_logits [V']) -> (draft index (0-dim long), processed target-vocab logits [V])`,
            choosing the token (top-1 or sampled) and returning the distribution it was chosen from; levels past
            the first get the first `deep_vocab` draft logits only when that is given.
    Returns:
        (target token ids, one 0-dim tensor per level; processed logits `[V]` per level).
    """
    drafter, config = session.drafter, session.drafter.config
    tokens, logits = [], []
    session.begin_round(depth - 1)
    feature, _ = session.run(config.specialist_for_position(1))
    for level in range(1, depth + 1):
        draft_index, processed = pick(level, drafter.logits(feature, deep_vocab if level > 1 else None).float())
        token = drafter.to_target_ids(draft_index)
        tokens.append(token)
        logits.append(processed)
        if level == depth:
            break
        inputs = drafter.project(token.reshape(1, 1), feature.reshape(1, 1, -1))[0]
        parent = torch.tensor([level - 2], device=inputs.device)  # previous chain node (-1 = root for level 1)
        session.add_nodes(inputs, session.context_length + level - 1, parent)
        _, feature = session.run(config.specialist_for_position(level + 1))
        feature = feature[-1]
    return tokens, logits
