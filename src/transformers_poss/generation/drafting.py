"""Drafting with position specialists: per-specialist KV caches, the EAGLE-2 dynamic tree, and a chain.

Positions. The target has processed tokens `x_0 .. x_{L-2}` and produced features `f_0 .. f_{L-2}`; `x_{L-1}` (the
*root*, last accepted token) is not yet through the target. Drafter position `i` holds the pair
`(x_{i+1}, f_i)`; the committed context is positions `0 .. S-1` with `S = L - 1`. Its output at `S - 1` predicts
`f_{L-1}`, whose logits give the tokens of draft level 1. A level-`d` node is fed back at drafter position
`S - 1 + d` with its parent's predicted feature.

Caches. The layer inputs `fc(...)` of the committed context are stored once. Specialist `s` keeps its own keys and
values (layer `s` of a `DraftKVCache`), caught up lazily over the context the first time a round reaches it, then
the draft levels of the current round on top; `end_round` forgets the draft levels. With
`config.shared_context_kv` the specialists share one layer instead: the context's keys/values are written by the
specialist of draft position 1 and each level's nodes by the specialist that runs them, once (the PosS authors'
PosS-on-EAGLE-3 drafters were trained so).

Batches. A session drafts for `B` rows at once (one specialist forward per depth for all rows); a single prompt is a
batch of one. Row `b` has its own committed length `S_b`; its context sits in slots `0 .. S_b - 1` of every buffer
and the round's nodes, which every row has the same number of, in slots `M .. M + N - 1` with `M = max_b S_b`, so
the nodes of all rows are written and masked alike. Slots between `S_b` and `M` are masked for row `b`.

Cost. A draft round works in buffers that grow only when a call needs more room: the context's layer inputs, each
specialist's keys and values (written in place, never concatenated), the round's node inputs and positions, and the
scored candidates; the round's attention mask is made once per round and filled in place as nodes are added. Shapes
per depth are static (the frontier is always `min(top_k, draft vocabulary)` wide); until the trees are assembled the
host reads one flag per depth: whether any row's next level could still enter its tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..binding import BoundDrafter


def _grown(buffer: torch.Tensor | None, rows: int, like: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`buffer` if it holds at least `rows` along `dim`, else a zero-filled buffer twice that size (shaped like `like`
    elsewhere) with the old contents copied. Zeros: masked slots are still read by attention, and must be finite."""
    if buffer is not None and buffer.shape[dim] >= rows:
        return buffer
    shape = list(like.shape)
    shape[dim] = max(2 * rows, 16)
    grown = like.new_zeros(shape)
    if buffer is not None:
        grown.narrow(dim, 0, buffer.shape[dim]).copy_(buffer)
    return grown


class DraftKVCache:
    """Keys and values of the drafter's specialists, one layer each, for `B` rows, written in place into growing
    buffers at slots the session chooses.

    It speaks the one cache method transformers' attention layers call, `update(keys, values, layer_idx)`, with
    `keys`/`values` `[B, H_kv, q, D]`: query `j` of row `b` is written at slot `slots + j` (an int, the same for every
    row) or `slots[b, j]` (a `[B, q]` tensor), as set by `write_at`; it returns the first `width` slots of the layer
    `[B, H_kv, width, D]` (views). One slot past `width` is kept for writes that nothing reads (padded queries).
    With `shared`, every `layer_idx` reads and writes the one layer it holds.
    """

    def __init__(self, num_layers: int, shared: bool = False):
        self.shared = shared
        num_layers = 1 if shared else num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slots: int | torch.Tensor = 0
        self.width = 0
        self._rows: torch.Tensor | None = None

    def write_at(self, slots: int | torch.LongTensor, width: int) -> None:
        self.slots, self.width = slots, width

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer_idx = 0 if self.shared else layer_idx
        self.keys[layer_idx] = keys = _grown(self.keys[layer_idx], self.width + 1, key_states, dim=-2)
        self.values[layer_idx] = values = _grown(self.values[layer_idx], self.width + 1, value_states, dim=-2)
        if isinstance(self.slots, int):
            end = self.slots + key_states.shape[-2]
            keys[..., self.slots : end, :].copy_(key_states)
            values[..., self.slots : end, :].copy_(value_states)
        else:
            if self._rows is None or self._rows.shape[0] != keys.shape[0]:
                self._rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
            keys.transpose(1, 2)[self._rows, self.slots] = key_states.transpose(1, 2)
            values.transpose(1, 2)[self._rows, self.slots] = value_states.transpose(1, 2)
        return keys[..., : self.width, :], values[..., : self.width, :]

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keep the rows `index` `[B']`, in that order."""
        self.keys = [None if k is None else k[index] for k in self.keys]
        self.values = [None if v is None else v[index] for v in self.values]


class DraftSession:
    """Drafter state across the rounds of one `generate` call, for `batch_size` rows: `drafter` is the call's
    binding of the drafter to its target."""

    def __init__(self, drafter: BoundDrafter, batch_size: int = 1):
        self.drafter = drafter
        self.shared = drafter.config.shared_context_kv
        n = 1 if self.shared else drafter.config.num_specialists  # caches kept (one per specialist, or one shared)
        self.batch_size = batch_size
        self.cache = DraftKVCache(n, shared=self.shared)
        self.lengths = [0] * batch_size  # S_b: committed positions of each row
        self._lengths_tensor: torch.Tensor | None = None  # the same `[B, 1]`, on the drafter's device
        self._context_inputs: torch.Tensor | None = None  # [B, >= max S_b, layer_input_size] committed layer inputs
        self.context_cached: list[list[int] | None] = [None] * n  # each cache's context positions per row
        self.nodes_cached = [0] * n  # round nodes in each cache
        self.context_features: list[torch.Tensor | None] = [None] * n  # output at S_b - 1 [B, H] of each cache's run
        self.node_count = 0  # N: round nodes fed so far (per row)
        self._node_inputs: torch.Tensor | None = None  # [B, >= N, layer_input_size]
        self._node_positions: torch.Tensor | None = None  # [B, >= N]
        # The round's additive mask [B, capacity + 1, M + capacity] over the cache slots: node i (row i) sees its row's
        # context and its ancestors and itself (0), nothing else (min). The last row sees the context only: the row
        # the root's children copy as their "parent's".
        self._round_mask: torch.Tensor | None = None
        self._diagonal: torch.Tensor | None = None  # arange of the node capacity
        self._batch_index: torch.Tensor | None = None  # arange(B)[:, None]

    @property
    def context_length(self) -> int:
        """`M = max_b S_b`: where the round's nodes start in every row (S for a single row)."""
        return max(self.lengths)

    @property
    def context_inputs(self) -> torch.Tensor:
        """Layer inputs of the committed context `[B, M, layer_input_size]` (row b's are its first `S_b`)."""
        return self._context_inputs[:, : self.context_length]

    @property
    def node_inputs(self) -> torch.Tensor:
        """Layer inputs of this round's fed nodes `[B, N, layer_input_size]`."""
        return self._node_inputs[:, : self.node_count]

    @property
    def node_positions(self) -> torch.LongTensor:
        """Drafter positions of this round's fed nodes `[B, N]`."""
        return self._node_positions[:, : self.node_count]

    @torch.no_grad()
    def commit(self, target_features: torch.Tensor, next_tokens: torch.LongTensor) -> None:
        """Append committed positions to a single-row session: target features `[n, nH]` of accepted tokens
        (`drafter.target_features`) and the tokens after them `[n]`."""
        self.commit_rows([target_features], [next_tokens])

    @torch.no_grad()
    def commit_rows(self, target_features: list[torch.Tensor], next_tokens: list[torch.LongTensor]) -> None:
        """Append committed positions to every row: per row, target features `[n_b, nH]` and next tokens `[n_b]`
        (`n_b >= 1`)."""
        if len(target_features) != self.batch_size or len(next_tokens) != self.batch_size:
            raise ValueError(f"commit_rows needs one entry per row ({self.batch_size})")
        counts = [f.shape[0] for f in target_features]
        width = max(counts)
        if width == 0:
            return
        features = torch.stack([F.pad(f, (0, 0, 0, width - n)) for f, n in zip(target_features, counts)])
        tokens = torch.stack([F.pad(t, (0, width - n)) for t, n in zip(next_tokens, counts)])
        inputs = self.drafter.project(tokens, self.drafter.fuse_features(features))  # [B, width, W]
        self._context_inputs = _grown(self._context_inputs, max(s + n for s, n in zip(self.lengths, counts)), inputs,
                                      dim=1)
        for b, n in enumerate(counts):
            self._context_inputs[b, self.lengths[b] : self.lengths[b] + n] = inputs[b, :n]
            self.lengths[b] += n
        self._lengths_tensor = torch.tensor(self.lengths, device=inputs.device)[:, None]

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keep the rows `index` `[B']` (e.g. those that go on generating), in that order; between rounds."""
        rows = index.tolist()
        self.batch_size = len(rows)
        self.lengths = [self.lengths[b] for b in rows]
        self._lengths_tensor = self._lengths_tensor[index]
        self._context_inputs = self._context_inputs[index]
        self.cache.select_rows(index)
        self.context_cached = [None if c is None else [c[b] for b in rows] for c in self.context_cached]
        self.context_features = [None if f is None else f[index] for f in self.context_features]
        self._node_inputs = self._node_positions = self._batch_index = None

    def begin_round(self, max_nodes: int) -> None:
        """Make room for up to `max_nodes` fed nodes per row this round (node buffers grow only when a round needs
        more) and make the round's attention mask."""
        weight, B = self.drafter.fc.weight, self.batch_size
        if self._node_inputs is None or self._node_inputs.shape[1] < max_nodes:
            capacity = max(max_nodes, 8)
            self._node_inputs = weight.new_zeros(B, capacity, self.drafter.layer_input_size)
            self._node_positions = torch.zeros(B, capacity, dtype=torch.long, device=weight.device)
            self._diagonal = torch.arange(capacity, device=weight.device)
            self._batch_index = torch.arange(B, device=weight.device)[:, None]
        capacity, M = self._node_inputs.shape[1], self.context_length
        self._round_mask = torch.full((B, capacity + 1, M + capacity), torch.finfo(weight.dtype).min, dtype=weight.dtype,
                                      device=weight.device)
        for b, length in enumerate(self.lengths):
            self._round_mask[b, :, :length] = 0

    def end_round(self) -> None:
        """Forget this round's draft levels (their cache slots are rewritten by the next round's)."""
        self.nodes_cached = [0] * len(self.nodes_cached)
        self.node_count = 0

    def add_nodes(self, inputs: torch.Tensor, level: int, parent_nodes: torch.LongTensor) -> int:
        """Feed round nodes of draft level `level` (>= 2): layer inputs `[B, n, layer_input_size]`, at drafter
        position `S_b + level - 2` of each row, parent node index `[B, n]` (-1: the root). Returns the index of the
        first new node."""
        first, n = self.node_count, inputs.shape[1]
        if self._node_inputs is None or first + n > self._node_inputs.shape[1]:
            raise RuntimeError("DraftSession.begin_round must reserve room for the round's nodes")
        rows = self._diagonal[first : first + n]
        self._node_inputs[:, first : first + n] = inputs
        self._node_positions[:, first : first + n] = self._lengths_tensor + (level - 2)
        mask = self._round_mask
        parent_rows = torch.where(parent_nodes >= 0, parent_nodes, mask.shape[1] - 1)
        mask[:, first : first + n] = mask[self._batch_index, parent_rows]
        mask[:, rows, self.context_length + rows] = 0
        self.node_count = first + n
        return first

    @torch.no_grad()
    def run(self, specialist: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring `specialist` up to date over the context and round nodes.

        Returns:
            (feature predicted at each row's last context position `[B, H]`, predicted features of the round nodes
            it had not yet run `[B, n_new_nodes, H]`). With a shared cache, "it" is whichever specialist ran last:
            the context's feature is the one of the specialist that caught the cache up over the context.
        """
        S, M, N = self.lengths, self.context_length, self.node_count
        slot = 0 if self.shared else specialist  # whose bookkeeping: the shared cache's or the specialist's
        cached, r = self.context_cached[slot] or [0] * self.batch_size, self.nodes_cached[slot]
        if cached == S and r == N:  # already up to date (a second draft on the same context)
            return self.context_features[slot], self._context_inputs[:, :0]
        dtype, device = self._context_inputs.dtype, self._context_inputs.device
        minimum = torch.finfo(dtype).min
        if cached == S:  # the common case: only this round's new nodes, in slots M + r .. M + N - 1 of every row
            queries, positions = self._node_inputs[:, r:N], self._node_positions[:, r:N]
            mask = self._round_mask[:, r:N, : M + N]
            slots, new = M + r, 0
        else:  # catch up over each row's new context positions, then every node of the round
            assert r == 0, "a specialist's round nodes must sit on a complete context"
            counts = [s - c for s, c in zip(S, cached)]
            new = max(counts)
            steps = torch.arange(new, device=device)
            start = torch.tensor(cached, device=device)[:, None]
            count = torch.tensor(counts, device=device)[:, None]
            real = steps[None, :] < count  # [B, new]: padded queries repeat the row's last new position
            context_positions = torch.where(real, start + steps, start + count - 1)
            queries = self._context_inputs[torch.arange(self.batch_size, device=device)[:, None], context_positions]
            slot_ids = torch.arange(M + N, device=device)
            allowed = slot_ids[None, None, :] <= context_positions[:, :, None]  # causal over the context slots
            context_mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, minimum)
            context_mask[..., M:] = minimum
            positions = context_positions
            slots = torch.where(real, context_positions, M + N)  # padded queries write past what is read
            if N:
                queries = torch.cat((queries, self._node_inputs[:, :N]), dim=1)
                positions = torch.cat((positions, self._node_positions[:, :N]), dim=1)
                context_mask = torch.cat((context_mask, self._round_mask[:, :N, : M + N]), dim=1)
                slots = torch.cat((slots, (M + self._diagonal[:N]).expand(self.batch_size, N)), dim=1)
            mask = context_mask
        self.cache.write_at(slots, M + N)
        out = self.drafter.run_specialist(specialist, queries, positions, mask[:, None], self.cache, M + N)
        self.context_cached[slot], self.nodes_cached[slot] = list(S), N
        if new:
            last = torch.tensor([n - 1 for n in counts], device=device)
            self.context_features[slot] = out[torch.arange(self.batch_size, device=device), last]
        return self.context_features[slot], out[:, new:]


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


def _log_probs(drafter: BoundDrafter, features: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(drafter.logits(features).float(), dim=-1)


@torch.no_grad()
def draft_tree(session: DraftSession, root_token: torch.LongTensor, depth: int, top_k: int,
               total_tokens: int) -> DraftTree:
    """The draft tree of a single-row session (see `draft_trees`), rooted at `root_token` (0-dim)."""
    return draft_trees(session, root_token.reshape(1), [depth], top_k, total_tokens)[0]


@torch.no_grad()
def draft_trees(session: DraftSession, root_tokens: torch.LongTensor, depths: list[int], top_k: int,
                total_tokens: int) -> list[DraftTree]:
    """EAGLE-2 dynamic trees with position specialists, one per row of `session`, rooted at `root_tokens` `[B]`.

    Depth 1 expands the root's top-k; each later depth feeds the `top_k` best frontier nodes through the specialist
    of that position, takes each node's top-k by cumulative log-probability and keeps the best `top_k` of `top_k^2` as the next frontier. All scored candidates are
    reranked; the best `total_tokens - 1` (closed under ancestors, since a child never scores above its parent) form
    the tree with the root. Rows draft together to the deepest of `depths`; row b's tree takes the candidates of
    depth <= `depths[b]` only, which are the ones a draft of that depth scores.

    Drafting stops early, at no cost to the trees, once no row's next level could enter its tree (`level_rank`): a
    child scores at most its parent, so when a level's best candidate does not beat the budget's worst, nothing
    deeper will. A deep budget then runs its later specialists only in rounds where their nodes can be verified.
    """
    drafter, config = session.drafter, session.drafter.config
    device = root_tokens.device
    budgets = [min(total_tokens - 1, max_tree_nodes(d, top_k)) if d > 0 else 0 for d in depths]
    depth = max((d for d, budget in zip(depths, budgets) if budget > 0), default=0)
    if depth == 0:
        return [_make_tree(root, device) for root in root_tokens]

    root_features, _ = session.run(config.specialist_for_position(1))  # [B, H]
    log_probs = _log_probs(drafter, root_features)  # [B, V']
    B, k = log_probs.shape[0], min(top_k, log_probs.shape[-1])  # k: the frontier's width at every depth
    session.begin_round((depth - 1) * k)
    capacity = k + (depth - 1) * k * k
    cand_tokens = torch.empty(B, capacity, dtype=torch.long, device=device)
    cand_parents = torch.empty(B, capacity, dtype=torch.long, device=device)
    cand_depths = torch.empty(B, capacity, dtype=torch.long, device=device)
    cand_scores = torch.empty(B, capacity, dtype=torch.float32, device=device)
    scores, draft_ids = log_probs.topk(k)  # [B, k]
    cand_tokens[:, :k] = drafter.to_target_ids(draft_ids)
    cand_scores[:, :k] = scores
    cand_parents[:, :k] = -1
    cand_depths[:, :k] = 1
    frontier = torch.arange(k, device=device).expand(B, k)  # candidate indices
    frontier_scores, frontier_tokens = scores, cand_tokens[:, :k]
    frontier_features = root_features[:, None].expand(-1, k, -1)
    frontier_nodes = torch.full((B, k), -1, dtype=torch.long, device=device)  # fed-node index of each one's parent
    row_budgets = torch.tensor(budgets, device=device)
    row_depths = torch.tensor(depths, device=device)
    count, reached = k, 1
    for d in range(2, depth + 1):
        grows = level_rank(cand_scores[:, :count], frontier_scores.amax(-1)) < row_budgets
        if not bool((grows & (row_depths >= d)).any()):
            break
        reached = d
        inputs = drafter.project(frontier_tokens, frontier_features)  # [B, k, W]
        first = session.add_nodes(inputs, d, frontier_nodes)
        _, node_features = session.run(config.specialist_for_position(d))
        node_features = node_features[:, -k:]  # [B, k, H]
        child_scores, child_ids = _log_probs(drafter, node_features).topk(k, dim=-1)  # [B, k, k]
        cumulative = (frontier_scores[..., None] + child_scores).reshape(B, k * k)
        new = slice(count, count + k * k)
        cand_tokens[:, new] = drafter.to_target_ids(child_ids.reshape(B, k * k))
        cand_scores[:, new] = cumulative
        cand_parents[:, new] = frontier.repeat_interleave(k, dim=1)
        cand_depths[:, new] = d
        if d < depth:
            frontier_scores, keep = cumulative.topk(k)  # [B, k]
            frontier = count + keep
            frontier_tokens = cand_tokens.gather(1, frontier)
            parent_of_kept = keep // k
            frontier_features = node_features.gather(1, parent_of_kept[..., None].expand_as(node_features))
            frontier_nodes = first + parent_of_kept
        count += k * k

    trees = []
    for b, (row_depth, budget) in enumerate(zip(depths, budgets)):
        if budget <= 0 or row_depth <= 0:
            trees.append(_make_tree(root_tokens[b], device))
            continue
        n = k + (min(row_depth, reached) - 1) * k * k  # candidates of depth <= row_depth come first
        candidates = DraftCandidates(cand_tokens[b, :n], cand_parents[b, :n], cand_depths[b, :n], cand_scores[b, :n])
        trees.append(_make_tree(root_tokens[b], device, candidates, select_candidates(candidates.scores, budget),
                                row_depth))
    return trees


def level_rank(scores: torch.Tensor, level_best: torch.Tensor) -> torch.LongTensor:
    """How many of a row's candidates so far `scores` `[B, C]` score at least its newest level's best `level_best`
    `[B]`, `[B]`. Once that reaches the row's budget no deeper candidate can enter its tree: a child scores at most
    its parent, and a tie goes to the earlier candidate (`select_candidates`)."""
    return (scores >= level_best[:, None]).sum(-1)


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
def draft_chain(session: DraftSession, depth: int, pick) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Draft `depth` tokens along one path.

    Args:
        pick: `pick(level, draft_logits [V']) -> (draft index (0-dim long), processed target-vocab logits [V])`,
            choosing the token (top-1 or sampled) and returning the distribution it was chosen from.
    Returns:
        (target token ids, one 0-dim tensor per level; processed logits `[V]` per level).
    """
    drafter, config = session.drafter, session.drafter.config
    if session.batch_size != 1:
        raise ValueError("draft_chain drafts for a single-row session")
    tokens, logits = [], []
    session.begin_round(depth - 1)
    feature = session.run(config.specialist_for_position(1))[0][0]
    for level in range(1, depth + 1):
        draft_index, processed = pick(level, drafter.logits(feature).float())
        token = drafter.to_target_ids(draft_index)
        tokens.append(token)
        logits.append(processed)
        if level == depth:
            break
        inputs = drafter.project(token.reshape(1, 1), feature.reshape(1, 1, -1))
        parent = torch.tensor([[level - 2]], device=inputs.device)  # previous chain node (-1 = root for level 1)
        session.add_nodes(inputs, level + 1, parent)
        feature = session.run(config.specialist_for_position(level + 1))[1][0, -1]
    return tokens, logits
