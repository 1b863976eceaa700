"""Tree verification for a batch of (left-padded) prompts: every row drafts its own tree, one target forward verifies
them all, every row accepts its own path.

Representation. The target's `DynamicCache` stays rectangular, `[B, H_kv, T, D]`, with a bool `valid [B, T]` saying
which slots each row attends to: a left-padded prompt starts with its padding invalid. After each round every row's
accepted nodes move to the slots right after the context (`T` grows by the longest accepted path `W`, a row that
accepted fewer leaves the rest as invalid holes), so a round copies only the tree's slots, never the whole cache.
Positions are each row's count of valid slots, as generate's `cumsum - 1` gives for the padded prompt. When the holes
grow past `MAX_HOLES` slots beyond the longest row (or at once for targets with sliding-window layers, whose window
counts slots) one gather per layer re-aligns every row to the right, back to the left-padded layout with `T` = the
longest row. Rows that stop (EOS, stopping criteria) leave the batch: their cache rows are dropped.

One `DraftSession` drafts every row's tree at once (one specialist forward per depth for the whole batch), fed from
each row's verified nodes; rows that leave the batch leave it too. A round verifies the trees padded to the largest
one; padding nodes attend to themselves only, no real node sees them, and they are never accepted.

Finished rows are padded as plain `generate` pads them: with `pad_token_id` after the row's end when generate has an
EOS criterion; without one, plain generate keeps generating a finished row until every row is done, and so does this
loop. Each row's stopping criteria and logits processors see that row's own sequence `[1, L_b]` (its left padding
included), which is the row plain batched generate sees.
"""

from __future__ import annotations

import time

import torch

from ..modeling_poss import PosSDrafter
from .drafting import DraftSession, DraftTree, draft_trees, graft_branch, lookup_continuation
from .stats import GenerationStats, PosSGenerateOutput, RoundTrace
from .tree_decoding import (
    TreeLogits, _accept_greedy, _accept_sampling, _append, _choose, _logits_to_keep, attention_mask_for, compact_cache,
    has_sliding_window, keep_accepted, keeps_every_tree_row,
)

MAX_HOLES = 32  # cache slots beyond the longest row before the rows are re-aligned (attention over holes is cheap)


def left_padding(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Padding slots per row `[B]` of a left-padded 2D `attention_mask`; `ValueError` for any other padding."""
    pad = (attention_mask == 0).sum(dim=1)
    expected = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :] >= pad[:, None]
    if not torch.equal(attention_mask.bool(), expected) or bool((pad == attention_mask.shape[1]).any()):
        raise ValueError(
            "generate() with a PosS drafter takes padded batches with left padding only, every row with at least one "
            "token: tokenize with padding_side='left'."
        )
    return pad


class _Row:
    """One prompt of the batch: its sequence `[1, L_b]` (`pad` slots of left padding included) and statistics."""

    def __init__(self, input_ids: torch.LongTensor, pad: int, stats: GenerationStats):
        self.input_ids, self.pad = input_ids, pad
        self.stats = stats
        self.finished_length: int | None = None  # sequence length when a stopping criterion first fired

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def append(self, tokens, processed_rows, stopping_criteria, pads_finished_rows: bool) -> None:
        """Append tokens `[0-dim]`, checking the stopping criteria (with each token's processed logits `[V]`) until
        the row finishes.

        A finishing row takes no more tokens when generate pads finished rows, else it takes them all (as plain
        generate keeps generating it)."""
        emitted = 0
        if self.finished_length is None:
            self.input_ids, emitted, finished = _append(self.input_ids, tokens, processed_rows, stopping_criteria)
            if finished:
                self.finished_length = self.length
        if self.finished_length is not None and not pads_finished_rows and emitted < len(tokens):
            rest = torch.stack([t.reshape(()) for t in tokens[emitted:]]).to(self.input_ids.device)
            self.input_ids = torch.cat((self.input_ids, rest[None]), dim=1)


def batch_tree_assisted_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    drafter: PosSDrafter,
    attention_mask: torch.Tensor | None = None,
    **model_kwargs,
):
    """Speculative tree decoding of a batch `input_ids [B, P]` (left-padded as `attention_mask [B, P]` says).

    Returns the sequences `[B, P + longest]`, or with `return_dict_in_generate` a `PosSGenerateOutput` whose
    `speculative_stats` pools every row's rounds and whose `row_stats` holds one `GenerationStats` per row.
    """
    cache = model_kwargs["cache"]
    budget = drafter.generation_config
    device = input_ids.device
    batch = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    pad = left_padding(attention_mask)
    do_sample = bool(generation_config.do_sample)
    pads_finished_rows = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    feature_layers = drafter.config.input_feature_layers
    keep_rows = 0 if keeps_every_tree_row(model) else torch.empty(0, dtype=torch.long, device=device)
    rows = [
        _Row(input_ids[b : b + 1], int(pad[b]),
             GenerationStats(draft_mode="tree", tree_depth=budget.tree_depth,
                             round_traces=[] if budget.record_round_traces else None))
        for b in range(batch)
    ]

    # Prefill: the padded prompts with generate's position ids; each row's first token is its first root.
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, output_hidden_states=feature_layers, **_logits_to_keep(model, 1))
    raw = out.logits[:, -1].to(dtype=torch.float32, device=device)
    processed = logits_processor(input_ids, raw.clone()) if logits_processor else raw
    features = drafter.target_features(out.hidden_states)  # [B, P, nH]
    for b, row in enumerate(rows):
        row.append([_choose(processed[b], do_sample)], [processed[b]], stopping_criteria, pads_finished_rows)
    session = DraftSession(drafter, batch_size=batch)
    session.commit_rows([features[b, row.pad :] for b, row in enumerate(rows)],
                        [row.input_ids[0, row.pad + 1 :] for row in rows])
    valid = attention_mask.bool()  # [B', T] cache slots each row attends to
    max_holes = 0 if has_sliding_window(model) else MAX_HOLES
    active = _still_running(rows, generation_config.max_length, pads_finished_rows)
    if active and len(active) < batch:  # rows that ended at their first token leave the batch
        compact_cache(cache, rows=_as_index(active, device))
        session.select_rows(_as_index(active, device))
        valid = valid[_as_index(active, device)]

    while active and any(row.finished_length is None for row in rows):
        start = time.perf_counter()
        # Draft tokens each row can still emit; all rows draft together to the deepest, each tree cut to its own.
        rooms = [max(generation_config.max_length - rows[b].length - 1, 0) for b in active]
        roots = torch.stack([rows[b].input_ids[0, -1] for b in active])
        trees = draft_trees(session, roots, [min(budget.tree_depth, room) for room in rooms], budget.tree_top_k,
                            budget.tree_total_tokens, budget.deep_draft_vocab)
        drafted_sizes = [len(tree) for tree in trees]
        if budget.lookup_num_tokens:
            for i, (b, room) in enumerate(zip(active, rooms)):
                if room:
                    continuation = lookup_continuation(rows[b].input_ids[0, rows[b].pad :], budget.lookup_ngram_size,
                                                       min(budget.lookup_num_tokens, room))
                    trees[i] = graft_branch(trees[i], continuation)
        drafted = time.perf_counter()

        past = cache.get_seq_length()
        tokens, depths, allowed = _padded_trees(trees, valid)
        out = model(
            input_ids=tokens.to(device),
            position_ids=(valid.sum(dim=1, keepdim=True) + depths.to(device)),
            attention_mask=attention_mask_for(model, allowed.to(device)),
            cache=cache,
            use_cache=True,
            output_hidden_states=feature_layers,
            **_logits_to_keep(model, keep_rows),
        )
        hidden = out.hidden_states[-1]  # [B', n, H] final hidden states (logits)
        # Per row: the accepted node path; (the target's next token, processed logits [V] of each path node).
        paths, choices = [], []
        for i, (b, tree) in enumerate(zip(active, trees)):
            logits = TreeLogits(model, hidden[i, : len(tree)], out.logits[i, : len(tree)], tree, rows[b].input_ids,
                                logits_processor)
            path, next_token = (_accept_sampling if do_sample else _accept_greedy)(logits, tree)
            paths.append(path)
            choices.append((next_token, [logits[node] for node in path]))
        verified = time.perf_counter()

        features = drafter.target_features(out.hidden_states)  # [B', n, nH] what the drafters read
        for i, (b, tree, path) in enumerate(zip(active, trees, paths)):
            row = rows[b]
            next_token, processed_path = choices[i]
            new_tokens = [tree.tokens[node] for node in path[1:]] + [next_token]
            if row.stats.round_traces is not None:
                row.stats.round_traces.append(RoundTrace(tree.candidates, [int(t) for t in new_tokens]))
            row.append(new_tokens, processed_path, stopping_criteria, pads_finished_rows)
            row.stats.lookup_tokens += sum(1 for node in path[1:] if node >= drafted_sizes[i])
            row.stats.acceptance_lengths.append(len(path) - 1)
            row.stats.tree_sizes.append(len(tree))
        continuing = _still_running(rows, generation_config.max_length, pads_finished_rows)
        if continuing:
            keep = {b: i for i, b in enumerate(active)}
            accepted = [paths[keep[b]] for b in continuing]
            if len(continuing) < len(active):
                kept_rows = _as_index([keep[b] for b in continuing], device)
                compact_cache(cache, rows=kept_rows)
                session.select_rows(kept_rows)
                valid = valid[kept_rows]
            width = max(len(path) for path in accepted)
            keep_accepted(cache, past, accepted)
            lengths = torch.tensor([len(path) for path in accepted], device=device)
            valid = torch.cat((valid, torch.arange(width, device=device)[None] < lengths[:, None]), dim=1)
            if valid.shape[1] - int(valid.sum(dim=1).max()) > max_holes:
                valid = _realign(cache, valid)
            session.end_round()
            session.commit_rows([features[keep[b]][torch.tensor(path, device=features.device)]
                                 for b, path in zip(continuing, accepted)],
                                [rows[b].input_ids[0, -len(path) :] for b, path in zip(continuing, accepted)])
        # Drafting, the verification forward and the bookkeeping are shared: each row is charged an equal part.
        draft_share = (drafted - start) / len(active)
        verify_share = (verified - drafted) / len(active)
        bookkeeping_share = (time.perf_counter() - verified) / len(active)
        for b in active:
            rows[b].stats.draft_seconds.append(draft_share)
            rows[b].stats.verify_seconds.append(verify_share)
            rows[b].stats.bookkeeping_seconds.append(bookkeeping_share)
        active = continuing

    sequences = _final_sequences(rows, generation_config._pad_token_tensor)
    for row in rows:
        row.stats.new_tokens = min(row.length, sequences.shape[1]) - input_ids.shape[1]
    if generation_config.return_dict_in_generate:
        row_stats = [row.stats for row in rows]
        return PosSGenerateOutput(sequences=sequences, cache=cache,
                                  speculative_stats=GenerationStats.pooled(row_stats), row_stats=row_stats)
    return sequences


def _still_running(rows: list[_Row], max_length: int, pads_finished_rows: bool) -> list[int]:
    """Rows that go on drafting: unfinished ones, and finished ones that plain generate keeps generating (no EOS
    criterion) while they are shorter than `max_length` and some row is unfinished."""
    if all(row.finished_length is not None for row in rows):
        return []
    return [b for b, row in enumerate(rows)
            if row.finished_length is None or (not pads_finished_rows and row.length < max_length)]


def _as_index(rows: list[int], device) -> torch.LongTensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _padded_trees(trees: list[DraftTree], valid: torch.Tensor):
    """The trees of a round padded to the largest, `n` nodes each, over a cache whose slots `valid [B', T]` says.

    Returns tokens `[B', n]`, depths `[B', n]` and the bool attention pattern `[B', n, T + n]`: row b's real nodes
    see its valid context slots, their ancestors and themselves; padding nodes see themselves only.
    """
    n = max(len(tree) for tree in trees)
    past = valid.shape[1]
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    depths = torch.zeros(len(trees), n, dtype=torch.long)
    visible = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)  # [B', n, n]
    real = torch.zeros(len(trees), n, dtype=torch.bool)
    for i, tree in enumerate(trees):
        size = len(tree)
        tokens[i, :size], depths[i, :size] = tree.tokens.cpu(), tree.depths.cpu()
        visible[i, :size, :size] = tree.visible.cpu()
        real[i, :size] = True
    context = valid[:, None, :] & real.to(valid.device)[:, :, None]  # [B', n, T]
    return tokens, depths, torch.cat((context, visible.to(valid.device)), dim=2)


def _realign(cache, valid: torch.Tensor) -> torch.Tensor:
    """Move every row's valid slots to the right end, in order, with `T'` = the longest row (one gather per layer);
    returns the new `valid [B', T']`, the left-padded layout."""
    lengths = valid.sum(dim=1)
    width = int(lengths.max())
    # A stable sort on validity lists each row's invalid slots, then its valid ones in order; keep the last `width`.
    order = torch.sort(valid.long(), dim=1, stable=True).indices[:, valid.shape[1] - width :]
    compact_cache(cache, order)
    return torch.arange(width, device=valid.device)[None] >= (width - lengths)[:, None]


def _final_sequences(rows: list[_Row], pad_token_id) -> torch.LongTensor:
    """Every row cut at the batch's end (where the last row finished) and right-padded to it `[B, L]`."""
    end = max(row.finished_length for row in rows)
    sequences = []
    for row in rows:
        ids = row.input_ids[0, :end]
        if ids.shape[0] < end:
            ids = torch.cat((ids, pad_token_id.to(ids).reshape(1).expand(end - ids.shape[0])))
        sequences.append(ids)
    return torch.stack(sequences)
