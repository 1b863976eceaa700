"""Tree verification loop: draft a tree, verify it in one target forward, accept a path, compact, repeat.

Entered from `target.generate(..., assistant_model=drafter)` when `drafter.generation_config.draft_mode == "tree"`.
It keeps what `generate` prepared: logits processors (and warpers when sampling), stopping criteria (max length, EOS,
stop strings, user criteria), the streamer, and `return_dict_in_generate` with `sequences` (and `scores` /
`logits` on request) and the call's `speculative_stats`.
"""

from __future__ import annotations

import time

import torch

from ..layers import additive_mask, output_logits
from ..modeling_poss import PosSDrafter
from .drafting import DraftSession, DraftTree, draft_tree, graft_branch, lookup_continuation
from .stats import GenerationStats, PosSGenerateOutput, RoundTrace


def tree_assisted_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    drafter: PosSDrafter,
    streamer=None,
    **model_kwargs,
):
    """Speculative decoding with a PosS draft tree. `input_ids` is `[1, prompt_len]`; returns the sequences `[1, L]`,
    or with `return_dict_in_generate` a `PosSGenerateOutput` that carries the call's `speculative_stats`."""
    cache = model_kwargs["cache"]
    budget = drafter.generation_config
    session = DraftSession(drafter)
    stats = GenerationStats(draft_mode="tree", tree_depth=budget.tree_depth,
                            round_traces=[] if budget.record_round_traces else None)
    do_sample = bool(generation_config.do_sample)
    return_dict = generation_config.return_dict_in_generate
    keep_scores = return_dict and generation_config.output_scores
    keep_logits = return_dict and generation_config.output_logits
    scores, raw_logits = [], []
    device = input_ids.device

    keep_rows = 0 if keeps_every_tree_row(model) else torch.empty(0, dtype=torch.long, device=device)

    # Prefill: the prompt through the target; its first token is the first root.
    prompt_len = input_ids.shape[1]
    feature_layers = drafter.config.input_feature_layers  # the target hidden states the drafter reads, the final one last
    out = model(
        input_ids=input_ids, position_ids=torch.arange(prompt_len, device=device)[None], cache=cache,
        use_cache=True, output_hidden_states=feature_layers, **_logits_to_keep(model, 1),
    )
    raw = out.logits[:, -1].to(dtype=torch.float32, device=device)
    processed = logits_processor(input_ids, raw.clone()) if logits_processor else raw
    token = _choose(processed[0], do_sample)
    input_ids, emitted, finished = _append(input_ids, [token], [processed], stopping_criteria)
    _record_outputs(scores, raw_logits, processed, raw, emitted, keep_scores, keep_logits)
    if streamer is not None:
        streamer.put(input_ids[:, -emitted:].cpu())
    stats.new_tokens += emitted
    session.commit(drafter.target_features(out.hidden_states)[0, :prompt_len], input_ids[0, 1 : prompt_len + 1])

    while not finished:
        start = time.perf_counter()
        length = input_ids.shape[1]
        room = max(generation_config.max_length - length - 1, 0)  # draft tokens that can still be emitted
        tree = draft_tree(session, input_ids[0, -1], min(budget.tree_depth, room), budget.tree_top_k,
                          budget.tree_total_tokens, budget.deep_draft_vocab)
        drafted_nodes = len(tree)
        if budget.lookup_num_tokens and room:
            continuation = lookup_continuation(input_ids[0], budget.lookup_ngram_size,
                                               min(budget.lookup_num_tokens, room))
            tree = graft_branch(tree, continuation)
        drafted = time.perf_counter()

        past = length - 1
        out = model(
            input_ids=tree.tokens[None].to(device),
            position_ids=(past + tree.depths)[None].to(device),
            attention_mask=tree_attention_mask(model, tree, past, device),
            cache=cache,
            use_cache=True,
            output_hidden_states=feature_layers,
            **_logits_to_keep(model, keep_rows),
        )
        hidden = out.hidden_states[-1][0]  # [n, H] final hidden states (logits)
        logits = TreeLogits(model, hidden, out.logits[0], tree, input_ids, logits_processor)
        path, next_token = (_accept_sampling if do_sample else _accept_greedy)(logits, tree)
        verified = time.perf_counter()

        new_tokens = [tree.tokens[i] for i in path[1:]] + [next_token]
        if stats.round_traces is not None:
            stats.round_traces.append(RoundTrace(tree.candidates, [int(t) for t in new_tokens]))
        processed_path = [logits[i] for i in path]
        input_ids, emitted, finished = _append(input_ids, new_tokens, processed_path, stopping_criteria)
        if keep_scores or keep_logits:
            _record_outputs(scores, raw_logits, torch.stack(processed_path), torch.stack([logits.raw(i) for i in path]),
                            emitted, keep_scores, keep_logits)
        if streamer is not None:
            streamer.put(input_ids[0, -emitted:].cpu())
        stats.new_tokens += emitted
        stats.lookup_tokens += sum(1 for node in path[1:] if node >= drafted_nodes)
        if not finished:
            keep_accepted(cache, past, [path])
            path_index = torch.tensor(path, device=device)
            session.end_round()
            features = drafter.target_features(out.hidden_states)[0]  # [n, nH] what the drafter reads
            session.commit(features[path_index.to(features.device)], input_ids[0, -len(path):])
        stats.record_round(len(path) - 1, len(tree), drafted - start, verified - drafted,
                           time.perf_counter() - verified)

    if streamer is not None:
        streamer.end()
    if return_dict:
        return PosSGenerateOutput(
            sequences=input_ids,
            scores=tuple(scores) if keep_scores else None,
            logits=tuple(raw_logits) if keep_logits else None,
            cache=cache,
            speculative_stats=stats,
        )
    return input_ids


def keeps_every_tree_row(model) -> bool:
    """Whether verification projects every tree node through the `lm_head` in its forward (one pass over the head).

    The alternative is `TreeLogits` projecting the rows acceptance visits one at a time (about tau of them). Reading
    the head's weights dominates in 16-bit and on accelerators: SmolLM2-135M's 49,152 x 576 head took 6.6 ms for one
    row and 9.5 ms for 14 in bf16 on a 2-core AVX-512 BF16 CPU, so one pass wins from tau ~1.5. In fp32 on a CPU the
    rows cost more (11 ms for one, 24 ms for 14 there), and visiting wins below tau ~2.2, where CPU drafters are.
    `python scripts/verify_cost.py --lm-head` measures both.
    """
    return model.device.type != "cpu" or model.dtype in (torch.bfloat16, torch.float16)


def _logits_to_keep(model, keep) -> dict:
    """`logits_to_keep` (an int: the last n positions; a 1D tensor: these positions) where the model takes it."""
    return {"logits_to_keep": keep} if model._supports_logits_to_keep() else {}


def _choose(processed: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Next token (0-dim) from processed logits `[V]`."""
    if do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), 1)[0]
    return processed.argmax()


def _append(input_ids, tokens, processed_rows, stopping_criteria):
    """Append tokens one at a time, stopping at the first that meets a stopping criterion.

    Returns (input_ids, number appended, finished).
    """
    for count, (token, row) in enumerate(zip(tokens, processed_rows), start=1):
        input_ids = torch.cat((input_ids, token.reshape(1, 1).to(input_ids.device)), dim=-1)
        if stopping_criteria(input_ids, row.reshape(1, -1)).any():
            return input_ids, count, True
    return input_ids, len(tokens), False


def _record_outputs(scores, raw_logits, processed, raw, emitted, keep_scores, keep_logits):
    if keep_scores:
        scores.extend(processed[i : i + 1] for i in range(emitted))
    if keep_logits:
        raw_logits.extend(raw[i : i + 1] for i in range(emitted))


def tree_allowed(tree: DraftTree, past: int) -> torch.Tensor:
    """Bool attention pattern `[n, past + n]`: every node sees the whole past, its ancestors and itself."""
    n = len(tree)
    return torch.cat((torch.ones(n, past, dtype=torch.bool, device=tree.visible.device), tree.visible), dim=1)


def tree_attention_mask(model, tree: DraftTree, past: int, device):
    """The 4D additive float mask `[1, 1, n, past + n]` (or Gemma3's per-layer-type dict of it)."""
    return attention_mask_for(model, tree_allowed(tree, past)[None].to(device))


def attention_mask_for(model, allowed: torch.Tensor):
    """Bool pattern `[B, q, k]` (True = attend) -> the 4D additive float mask `[B, 1, q, k]` the model takes as is
    (right for eager and sdpa), or Gemma3's per-layer-type dict of it."""
    mask = additive_mask(allowed, model.dtype)[0, 0][:, None]
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if layer_types:
        return {layer_type: mask for layer_type in set(layer_types)}
    return mask


class TreeLogits:
    """Target logits of tree nodes: all of them from the forward, or projected only for the nodes acceptance visits.

    In fp32 on a CPU (see `keeps_every_tree_row`) the verification forward keeps no logits where the model takes
    `logits_to_keep`; `raw(i)` then projects node `i`'s last hidden state `[H]` through the target's output
    embeddings (and Gemma's final soft-capping) on first use. Acceptance walks one root path, so about tau rows of
    `[V]` are projected instead of one per tree node. `self[i]` applies generate's logits processors with the
    node's own prefix (the sequence up to that node).
    """

    def __init__(self, model, hidden: torch.Tensor, logits: torch.Tensor, tree: DraftTree, input_ids,
                 logits_processor):
        self.model, self.hidden, self.tree = model, hidden, tree
        self.full_logits = logits if logits.shape[0] == len(tree) else None  # [n, V] when the model kept them all
        self.input_ids, self.logits_processor = input_ids, logits_processor
        self._raw: dict[int, torch.Tensor] = {}
        self._processed: dict[int, torch.Tensor] = {}

    def raw(self, node: int) -> torch.Tensor:
        """Unprocessed float32 logits `[V]` of `node`."""
        if node not in self._raw:
            if self.full_logits is not None:
                row = self.full_logits[node]
            else:
                row = output_logits(self.model, self.hidden[node : node + 1])[0]
            self._raw[node] = row.to(dtype=torch.float32, device=self.input_ids.device)
        return self._raw[node]

    def __getitem__(self, node: int) -> torch.Tensor:
        """Processed logits `[V]` of `node`."""
        if node not in self._processed:
            row = self.raw(node)
            if self.logits_processor:
                prefix = torch.cat((self.input_ids, self._path_tokens(node)[None]), dim=1)
                row = self.logits_processor(prefix, row[None].clone())[0]
            self._processed[node] = row
        return self._processed[node]

    def _path_tokens(self, node: int) -> torch.LongTensor:
        """Tokens `[depth]` from the root's child down to `node`."""
        parents = self.tree.parents.tolist()
        path = []
        while node > 0:
            path.append(node)
            node = parents[node]
        return self.tree.tokens[path[::-1]].to(self.input_ids.device)


def _children(tree: DraftTree) -> list[list[int]]:
    children = [[] for _ in range(len(tree))]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            children[parent].append(node)
    return children


def _accept_greedy(processed, tree: DraftTree) -> tuple[list[int], torch.Tensor]:
    """Longest root path whose every token is the target's argmax; returns (node path from 0, next token).

    `processed[i]` is node i's processed logits `[V]` (a `TreeLogits` or an `[n, V]` tensor).
    """
    tokens, children = tree.tokens.tolist(), _children(tree)
    path = [0]
    while True:
        node = path[-1]
        choice = processed[node].argmax()
        wanted = int(choice)
        child = next((c for c in children[node] if tokens[c] == wanted), None)
        if child is None:
            return path, choice
        path.append(child)


def _accept_sampling(processed, tree: DraftTree) -> tuple[list[int], torch.Tensor]:
    """Multi-candidate rejection sampling for deterministic (top-k) drafts; keeps the target distribution.

    At a node with target distribution p, children's tokens t_1..t_m are tried in turn: t_i is accepted with
    probability p(t_i), else p(t_i) is set to 0 and p renormalised. If none is accepted the next token is sampled from
    what is left of p. Each token t is thus output with probability exactly p(t).
    """
    tokens, children = tree.tokens.tolist(), _children(tree)
    path = [0]
    while True:
        node = path[-1]
        probs = torch.softmax(processed[node], dim=-1)
        accepted = None
        for child in children[node]:
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


def has_sliding_window(model) -> bool:
    """Whether the model has sliding-window attention layers (Gemma3's `layer_types`)."""
    return "sliding_attention" in (getattr(model.config.get_text_config(), "layer_types", None) or [])


def _initialized_layers(cache):
    return [layer for layer in cache.layers
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0]


def _set_states(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = keys.shape[-2]


def keep_accepted(cache, past: int, paths: list[list[int]]) -> None:
    """After a verification forward: keep each row's first `past` slots and move its accepted tree nodes (slots
    `past + path`) to slots `past, past + 1, ...`; the cache ends at `past + W` (`W` the longest path). Only the tree
    slots that move are copied: none when every path is `0, 1, 2, ...` (a root-only or first-child path). `paths`
    holds each row's node indices from the root (0); a shorter path's slots after its end are left as they are (the
    caller masks them)."""
    width = max(len(path) for path in paths)
    # Paths ascend (parents precede children), so slots before the first out-of-place node stay where they are.
    moved = min(next((i for i, node in enumerate(path) if node != i), len(path)) for path in paths)
    if moved < width:
        index = torch.tensor([path[moved:] + list(range(len(path), width)) for path in paths])
        gathers = {}  # one expanded index per layer shape and device, shared by the layers that have it
    for layer in _initialized_layers(cache):
        keys, values = layer.keys, layer.values
        if moved < width:
            shape = (keys.shape[1], keys.shape[-1], keys.device)
            if shape not in gathers:
                gathers[shape] = index.to(keys.device)[:, None, :, None].expand(-1, shape[0], -1, shape[1])
            gather = gathers[shape]
            keys[:, :, past + moved : past + width] = keys[:, :, past:].gather(-2, gather)
            values[:, :, past + moved : past + width] = values[:, :, past:].gather(-2, gather)
        _set_states(layer, keys[:, :, : past + width], values[:, :, : past + width])


def compact_cache(cache, keep: torch.LongTensor | None = None, rows: torch.LongTensor | None = None) -> None:
    """Keep only cache slots `keep` (dim -2) in every layer of a `DynamicCache`: `[B', T']` per row of a batch (None:
    every slot); with `rows` `[B']`, only those batch rows (dim 0), in that order."""
    for layer in _initialized_layers(cache):
        keys, values = layer.keys, layer.values
        if rows is not None:
            keys, values = keys.index_select(0, rows.to(keys.device)), values.index_select(0, rows.to(keys.device))
        if keep is not None:
            index = keep.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            keys, values = keys.gather(-2, index), values.gather(-2, index)
        _set_states(layer, keys, values)
