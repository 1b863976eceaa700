"""The tree loop: draft a tree per row, verify every row's tree in one target forward, accept a path per row, move
the accepted nodes into place in the caches, feed their target features to the drafter, repeat.

Entered from `target.generate(..., assistant_model=drafter)` in tree mode, for one prompt or a left-padded batch: a
single prompt is a batch of one. It keeps what `generate` prepared: logits processors (and warpers when sampling),
stopping criteria (max length, EOS, stop strings, user criteria), the streamer and per-step `scores` / `logits` (one
prompt), and `return_dict_in_generate` with `sequences` and the call's `speculative_stats`.

Rows. Every row drafts its own tree (one `DraftSession` drafts them together, one specialist forward per level for
the whole batch), fed from its own verified nodes. The target cache layout is `cache_surgery`'s; positions are each
row's count of valid slots, as generate's `cumsum - 1` gives for a padded prompt. Rows that stop leave the batch:
their target and drafter cache rows are dropped. Finished rows are padded as plain `generate` pads them: with
`pad_token_id` after the row's end when generate has an EOS criterion; without one, plain generate keeps generating
a finished row until every row is done, and so does this loop. Each row's stopping criteria and logits processors see
that row's own sequence `[1, L_b]` (its left padding included), which is the row plain batched generate sees.

Time. A round's drafting, verification forward and bookkeeping are shared by its rows: each is charged an equal part.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass

import torch

from ..binding import BoundDrafter
from .acceptance import accept, choose
from .cache_surgery import MAX_HOLES, compact_cache, has_sliding_window, keep_accepted, realign
from .drafting import DraftSession, DraftTree, draft_trees, graft_branch, lookup_continuation
from .stats import GenerationStats, PosSGenerateOutput
from .verification import TreeLogits, attention_mask_for, logits_to_keep, padded_trees, verification_rows


@dataclass
class RoundTrace:
    """One row's tree round as `poss tune` replays it.

    Attributes:
        candidates: the `DraftCandidates` the round's tree was cut from (None when only the root was verified).
        target_tokens: the accepted draft tokens followed by the target's own next token.
    """

    candidates: object
    target_tokens: list[int]


_round_observer: contextvars.ContextVar = contextvars.ContextVar("poss_round_observer", default=None)


@contextlib.contextmanager
def observe_rounds(observer):
    """Within the block, tree decoding calls `observer(trace)` with a `RoundTrace` for every row's round (what
    `poss tune` records to replay smaller budgets)."""
    token = _round_observer.set(observer)
    try:
        yield
    finally:
        _round_observer.reset(token)


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

    def append(self, tokens, processed_rows, stopping_criteria, pads_finished_rows: bool) -> int:
        """Append tokens (0-dim each) one at a time, checking the stopping criteria with each token's processed
        logits `[V]` until the row finishes; returns how many it took before finishing.

        A finishing row takes no more tokens when generate pads finished rows, else it takes them all (as plain
        generate keeps generating it)."""
        emitted = 0
        if self.finished_length is None:
            for token, row in zip(tokens, processed_rows):
                self.input_ids = torch.cat((self.input_ids, token.reshape(1, 1).to(self.input_ids.device)), dim=-1)
                emitted += 1
                if stopping_criteria(self.input_ids, row.reshape(1, -1)).any():
                    self.finished_length = self.length
                    break
        if self.finished_length is not None and not pads_finished_rows and emitted < len(tokens):
            rest = torch.stack([t.reshape(()) for t in tokens[emitted:]]).to(self.input_ids.device)
            self.input_ids = torch.cat((self.input_ids, rest[None]), dim=1)
        return emitted


def tree_assisted_decoding(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                           drafter: BoundDrafter, streamer=None, attention_mask: torch.Tensor | None = None,
                           **model_kwargs):
    """Speculative tree decoding of `input_ids [B, P]` (left-padded as `attention_mask [B, P]` says, when given).

    Returns the sequences `[B, P + longest]`, or with `return_dict_in_generate` a `PosSGenerateOutput`; for a batch
    (or a padded prompt) its `speculative_stats` pools every row's rounds and `row_stats` holds one `GenerationStats`
    per row.
    """
    loop = _TreeLoop(model, drafter, logits_processor, stopping_criteria, generation_config, streamer,
                     model_kwargs["cache"])
    return loop.run(input_ids, attention_mask)


class _TreeLoop:
    """The state of one tree-decoding call: the rows, the drafter session, the target cache and its `valid` slots."""

    def __init__(self, model, drafter: BoundDrafter, logits_processor, stopping_criteria, generation_config, streamer,
                 cache):
        self.model, self.drafter, self.cache, self.streamer = model, drafter, cache, streamer
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.budget, self.max_length = drafter.generation_config, generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.return_dict = generation_config.return_dict_in_generate
        self.keep_scores = self.return_dict and generation_config.output_scores
        self.keep_logits = self.return_dict and generation_config.output_logits
        self.scores, self.raw_logits = [], []  # per emitted token of a single row: processed / raw logits [1, V]
        self.pad_token_id = generation_config._pad_token_tensor
        self.pads_finished_rows = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        self.max_holes = 0 if has_sliding_window(model) else MAX_HOLES
        self.observer = _round_observer.get()

    # ---- the loop ----------------------------------------------------------------------------------------------
    def run(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None):
        self._prefill(input_ids, attention_mask)
        while self.active and any(row.finished_length is None for row in self.rows):
            start = time.perf_counter()
            trees, drafted_sizes = self._draft()
            drafted = time.perf_counter()
            past = self.cache.get_seq_length()
            out, accepted = self._verify(trees)
            verified = time.perf_counter()
            self._advance(trees, drafted_sizes, out, past, accepted)
            shares = [seconds / len(trees) for seconds in
                      (drafted - start, verified - drafted, time.perf_counter() - verified)]
            for b, tree, (path, _, _) in zip(self.active, trees, accepted):
                self.rows[b].stats.record_round(len(path) - 1, len(tree), *shares)
            self.active = self.continuing
        if self.streamer is not None:
            self.streamer.end()
        return self._output(input_ids)

    def _prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> None:
        """The prompts through the target with generate's position ids; each row's first token is its first root."""
        self.device, batch = input_ids.device, input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pad = left_padding(attention_mask)
        self.batched = batch > 1 or bool(pad.any())
        self.keep_rows = verification_rows(self.model, self.device)
        self.rows = [_Row(input_ids[b : b + 1], int(pad[b]),
                          GenerationStats(draft_mode="tree", tree_depth=self.budget.tree_depth)) for b in range(batch)]
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=self.cache, use_cache=True, output_hidden_states=self.drafter.config.input_feature_layers,
                         **logits_to_keep(self.model, 1))
        raw = out.logits[:, -1].to(dtype=torch.float32, device=self.device)
        processed = self.logits_processor(input_ids, raw.clone()) if self.logits_processor else raw
        for b, row in enumerate(self.rows):
            emitted = row.append([choose(processed[b], self.do_sample)], [processed[b]], self.stopping_criteria,
                                 self.pads_finished_rows)
            self._emit(row, emitted, processed[b : b + 1], raw[b : b + 1])
        features = self.drafter.target_features(out.hidden_states)  # [B, P, nH]
        self.session = DraftSession(self.drafter, batch_size=batch)
        self.session.commit_rows([features[b, row.pad :] for b, row in enumerate(self.rows)],
                                 [row.input_ids[0, row.pad + 1 :] for row in self.rows])
        self.valid = attention_mask.bool()  # [B', T] cache slots each row attends to
        self.active = self._still_running()
        if self.active and len(self.active) < batch:  # rows that ended at their first token leave the batch
            self._keep_rows(torch.tensor(self.active, device=self.device))

    def _draft(self) -> tuple[list[DraftTree], list[int]]:
        """Every active row's tree, drafted together to the deepest and cut to the tokens each row can still emit,
        with its prompt-lookup branch grafted on; and the number of drafted nodes of each."""
        rooms = [max(self.max_length - self.rows[b].length - 1, 0) for b in self.active]
        roots = torch.stack([self.rows[b].input_ids[0, -1] for b in self.active])
        budget = self.budget
        trees = draft_trees(self.session, roots, [min(budget.tree_depth, room) for room in rooms], budget.tree_top_k,
                            budget.tree_total_tokens)
        drafted_sizes = [len(tree) for tree in trees]
        if budget.lookup_num_tokens:
            for i, (b, room) in enumerate(zip(self.active, rooms)):
                if room:
                    row = self.rows[b]
                    continuation = lookup_continuation(row.input_ids[0, row.pad :], budget.lookup_ngram_size,
                                                       min(budget.lookup_num_tokens, room))
                    trees[i] = graft_branch(trees[i], continuation)
        return trees, drafted_sizes

    def _verify(self, trees: list[DraftTree]):
        """One target forward over every row's tree; per row, the accepted path, the target's next token and the
        `TreeLogits` acceptance read."""
        tokens, depths, allowed = padded_trees(trees, self.valid)
        out = self.model(
            input_ids=tokens.to(self.device),
            position_ids=self.valid.sum(dim=1, keepdim=True) + depths.to(self.device),
            attention_mask=attention_mask_for(self.model, allowed.to(self.device)),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.drafter.config.input_feature_layers,
            **logits_to_keep(self.model, self.keep_rows),
        )
        hidden = out.hidden_states[-1]  # [B', n, H] final hidden states (logits)
        accepted = []
        for i, (b, tree) in enumerate(zip(self.active, trees)):
            logits = TreeLogits(self.model, hidden[i, : len(tree)], out.logits[i, : len(tree)], tree,
                                self.rows[b].input_ids, self.logits_processor)
            path, next_token = accept(logits, tree, self.do_sample)
            accepted.append((path, next_token, logits))
        return out, accepted

    def _advance(self, trees, drafted_sizes, out, past: int, accepted) -> None:
        """Append each row's accepted tokens, drop the rows that stop, keep the accepted nodes in the target cache and
        commit their target features to the drafter."""
        for b, tree, drafted, (path, next_token, logits) in zip(self.active, trees, drafted_sizes, accepted):
            row = self.rows[b]
            new_tokens = [tree.tokens[node] for node in path[1:]] + [next_token]
            if self.observer is not None:
                self.observer(RoundTrace(tree.candidates, [int(t) for t in new_tokens]))
            processed_path = [logits[node] for node in path]
            emitted = row.append(new_tokens, processed_path, self.stopping_criteria, self.pads_finished_rows)
            if self.keep_scores or self.keep_logits:
                self._emit(row, emitted, torch.stack(processed_path), torch.stack([logits.raw(i) for i in path]))
            else:
                self._emit(row, emitted)
            row.stats.lookup_tokens += sum(1 for node in path[1:] if node >= drafted)
        self.continuing = self._still_running()
        if not self.continuing:
            return
        position = {b: i for i, b in enumerate(self.active)}
        if len(self.continuing) < len(self.active):
            self._keep_rows(torch.tensor([position[b] for b in self.continuing], device=self.device))
        paths = [accepted[position[b]][0] for b in self.continuing]
        keep_accepted(self.cache, past, paths)
        width = max(len(path) for path in paths)
        lengths = torch.tensor([len(path) for path in paths], device=self.device)
        self.valid = torch.cat((self.valid, torch.arange(width, device=self.device)[None] < lengths[:, None]), dim=1)
        if self.valid.shape[1] - int(self.valid.sum(dim=1).max()) > self.max_holes:
            self.valid = realign(self.cache, self.valid)
        features = self.drafter.target_features(out.hidden_states)  # [B', n, nH] what the drafter reads
        self.session.end_round()
        self.session.commit_rows(
            [features[position[b]][torch.tensor(path, device=features.device)]
             for b, path in zip(self.continuing, paths)],
            [self.rows[b].input_ids[0, -len(path) :] for b, path in zip(self.continuing, paths)])

    # ---- rows --------------------------------------------------------------------------------------------------
    def _emit(self, row: _Row, emitted: int, processed=None, raw=None) -> None:
        """Stream and record the `emitted` tokens a single row just took (processed / raw logits `[m, V]`)."""
        if self.streamer is not None and emitted:
            self.streamer.put(row.input_ids[0, -emitted:].cpu())
        if self.keep_scores:
            self.scores.extend(processed[i : i + 1] for i in range(emitted))
        if self.keep_logits:
            self.raw_logits.extend(raw[i : i + 1] for i in range(emitted))

    def _still_running(self) -> list[int]:
        """Rows that go on drafting: unfinished ones, and finished ones that plain generate keeps generating (no EOS
        criterion) while they are shorter than `max_length` and some row is unfinished."""
        if all(row.finished_length is not None for row in self.rows):
            return []
        return [b for b, row in enumerate(self.rows)
                if row.finished_length is None or (not self.pads_finished_rows and row.length < self.max_length)]

    def _keep_rows(self, index: torch.LongTensor) -> None:
        """Keep only the batch rows `index` `[B']` (positions among the active rows) in every cache."""
        compact_cache(self.cache, rows=index)
        self.session.select_rows(index)
        self.valid = self.valid[index]

    def _output(self, input_ids: torch.LongTensor):
        """Every row cut at the batch's end (where the last row finished) and right-padded to it `[B, L]`."""
        end = max(row.finished_length or row.length for row in self.rows)
        sequences = []
        for row in self.rows:
            ids = row.input_ids[0, :end]
            if ids.shape[0] < end:
                ids = torch.cat((ids, self.pad_token_id.to(ids).reshape(1).expand(end - ids.shape[0])))
            sequences.append(ids)
            row.stats.new_tokens = min(row.length, end) - input_ids.shape[1]
        sequences = torch.stack(sequences)
        if not self.return_dict:
            return sequences
        row_stats = [row.stats for row in self.rows]
        return PosSGenerateOutput(
            sequences=sequences,
            scores=tuple(self.scores) if self.keep_scores else None,
            logits=tuple(self.raw_logits) if self.keep_logits else None,
            cache=self.cache,
            speculative_stats=GenerationStats.pooled(row_stats) if self.batched else row_stats[0],
            row_stats=row_stats if self.batched else None,
        )
