"""`PosSCandidateGenerator`: chain drafting inside transformers' own assisted-generation loop."""

from __future__ import annotations

import time

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..binding import BoundDrafter
from .drafting import DraftSession, draft_chain
from .stats import GenerationStats


class PosSCandidateGenerator(CandidateGenerator):
    """Drafts `tree_depth` tokens along one path (top-1, or sampled when `do_sample`) with position specialists.

    It reads the target hidden states the drafter needs from the previous verification forward
    (`model_kwargs_overrides = {"output_hidden_states": drafter.config.input_feature_layers}`), feeds the accepted
    positions to the drafter, and returns the candidates with the processed drafter logits they were chosen from
    (`q` for speculative sampling).
    """

    requires_model_outputs = True

    def __init__(self, drafter: BoundDrafter, generation_config, logits_processor=None):
        """`generation_config` is the target's for this call (sampling, max length); the depth is the drafter's
        `generation_config.tree_depth`. The call's statistics accumulate in `self.stats`."""
        self.drafter = drafter
        self.model_kwargs_overrides = {"output_hidden_states": drafter.config.input_feature_layers}
        self.session = DraftSession(drafter)
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.logits_processor = logits_processor
        self.depth = drafter.generation_config.tree_depth
        self.stats = GenerationStats(draft_mode="chain", tree_depth=self.depth)
        self._prefilled = False
        self._round_start: float | None = None
        self._draft_seconds = 0.0
        self._drafted = 0

    @property
    def num_drafting_tokens(self) -> int:
        """Most tokens drafted per round (transformers >= 5.25 sizes the cache's rollback record from it)."""
        return self.depth

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        """`input_ids [1, L]` -> (`[1, L + n]` with n drafted tokens, processed logits `[1, n, V]` or None)."""
        if is_first_iteration:  # the target has not run yet: let the loop prefill and give us its features
            return input_ids, None
        start = time.perf_counter()
        features = self.drafter.target_features(model_outputs.hidden_states)[0]  # [n_verified, nH]
        count = features.shape[0] if not self._prefilled else int(n_last_matches) + 1  # prefill: the whole prompt
        self._prefilled = True
        self.session.end_round()
        self.session.commit(features[:count], input_ids[0, -count:].to(features.device))
        depth = min(self.depth, self.max_length - input_ids.shape[1] - 1)
        self._drafted = max(depth, 0)
        if depth <= 0:  # only the target's own next token fits: not a drafting round
            self._round_start = None
            return input_ids, None
        prefix = [input_ids]

        def pick(level, draft_logits):
            logits = self._to_target_vocab(draft_logits)
            if self.logits_processor:
                logits = self.logits_processor(torch.cat(prefix, dim=-1).to(logits.device), logits[None])[0]
            if self.do_sample:
                index = torch.multinomial(torch.softmax(logits, dim=-1), 1)[0]
            else:
                index = logits.argmax()
            prefix.append(index.reshape(1, 1).to(input_ids.device))
            return self._to_draft_index(index), logits

        tokens, logits = draft_chain(self.session, depth, pick)
        candidates = torch.stack(tokens).reshape(1, -1).to(input_ids.device)
        self._draft_seconds = time.perf_counter() - start
        self._round_start = time.perf_counter()
        return torch.cat((input_ids, candidates), dim=-1), torch.stack(logits)[None]

    def _to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits of the first `n` draft-vocabulary tokens `[n]` -> target-vocabulary logits `[V]` (-inf elsewhere)."""
        if self.drafter.draft_to_target is None:
            return draft_logits
        full = torch.full((self.drafter.config.vocab_size,), float("-inf"), device=draft_logits.device)
        return full.index_copy(0, self.drafter.draft_to_target[: draft_logits.shape[-1]], draft_logits)

    def _to_draft_index(self, token: torch.Tensor) -> torch.Tensor:
        if self.drafter.draft_to_target is None:
            return token
        return (self.drafter.draft_to_target == token).nonzero()[0, 0]

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.stats.new_tokens += int(num_matches) + 1
        if self._round_start is None:  # the prefill step, or a step with no room to draft: not a drafting round
            return
        verify = time.perf_counter() - self._round_start
        self.stats.record_round(int(num_matches), self._drafted + 1, self._draft_seconds, verify, 0.0)
        self._round_start = None
