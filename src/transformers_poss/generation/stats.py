"""`GenerationStats`: what one `generate` call with a PosS drafter did, round by round, and the output that carries
it."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..metrics import mean_acceptance_length, position_acceptance


@dataclass
class BudgetUsed:
    """The drafting budget one `generate` call ran with and where each value came from.

    Attributes:
        device_kind: the kind the target ran as (`transformers_poss.devices.device_kind`).
        settings: `{name: value}` of the budget settings as used (`generation_config.BUDGET_KEYS`).
        sources: `{name: source}`: "set by the user", "tuned for KIND" or "the drafter's default"
            (`generation_config.resolve_budget`).
    """

    device_kind: str
    settings: dict
    sources: dict

    def summary(self) -> dict:
        return {"device_kind": self.device_kind,
                **{name: {"value": value, "source": self.sources[name]} for name, value in self.settings.items()}}


@dataclass
class GenerationStats:
    """Per-round record of a speculative `generate` call (`output.speculative_stats` with
    `return_dict_in_generate=True`).

    Attributes:
        draft_mode: `"tree"` or `"chain"`.
        tree_depth: draft positions per round (the length of `position_acceptance`).
        acceptance_lengths: accepted draft tokens per round, bonus token excluded.
        draft_seconds / verify_seconds / bookkeeping_seconds: wall time per round spent drafting, in the target's
            verification forward and acceptance, and in cache compaction, feature feedback and stopping checks.
        tree_sizes: verified tokens per round (root included).
        new_tokens: tokens generated in total (prefill token included).
        lookup_tokens: accepted draft tokens that only the grafted prompt-lookup branch proposed (tree mode with
            `lookup_num_tokens`; counted in `acceptance_lengths` too).
        plain_reason: why the call decoded plainly without drafting (the drafter's settings for this device kind
            say speculation does not pay at this batch size), or None when it drafted.
        budget: the budget the call ran with and each value's source (`BudgetUsed`; set by `generate`).
    """

    draft_mode: str
    tree_depth: int
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    bookkeeping_seconds: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    new_tokens: int = 0
    lookup_tokens: int = 0
    plain_reason: str | None = None
    budget: BudgetUsed | None = None

    @classmethod
    def pooled(cls, rows: list[GenerationStats]) -> GenerationStats:
        """The rounds of every row of a batched call as one record (each row's round is one round here)."""
        pooled = cls(draft_mode=rows[0].draft_mode, tree_depth=rows[0].tree_depth,
                     new_tokens=sum(row.new_tokens for row in rows),
                     lookup_tokens=sum(row.lookup_tokens for row in rows))
        for name in ("acceptance_lengths", "draft_seconds", "verify_seconds", "bookkeeping_seconds", "tree_sizes"):
            setattr(pooled, name, [value for row in rows for value in getattr(row, name)])
        return pooled

    def record_round(self, accepted: int, tree_size: int, draft_s: float, verify_s: float, bookkeeping_s: float):
        self.acceptance_lengths.append(int(accepted))
        self.tree_sizes.append(int(tree_size))
        self.draft_seconds.append(draft_s)
        self.verify_seconds.append(verify_s)
        self.bookkeeping_seconds.append(bookkeeping_s)

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """tau = mean over rounds of (accepted + 1)."""
        return mean_acceptance_length(self.acceptance_lengths)

    @property
    def position_acceptance(self) -> list[float]:
        """[alpha_1, ..., alpha_depth], alpha_p = P(position p accepted | 1..p-1 accepted)."""
        return position_acceptance(self.acceptance_lengths, self.tree_depth)

    def time_split(self) -> dict[str, float]:
        """Total seconds spent drafting, verifying and in bookkeeping."""
        return {
            "draft": sum(self.draft_seconds),
            "verify": sum(self.verify_seconds),
            "bookkeeping": sum(self.bookkeeping_seconds),
        }

    def summary(self) -> dict:
        return {
            "draft_mode": self.draft_mode,
            "rounds": self.num_rounds,
            "new_tokens": self.new_tokens,
            "lookup_tokens": self.lookup_tokens,
            "plain_reason": self.plain_reason,
            "budget": None if self.budget is None else self.budget.summary(),
            "mean_acceptance_length": self.mean_acceptance_length,
            "position_acceptance": self.position_acceptance,
            "time_split_s": self.time_split(),
        }


@dataclass
class PosSGenerateOutput(GenerateDecoderOnlyOutput):
    """What `generate(..., assistant_model=drafter, return_dict_in_generate=True)` returns: transformers' decoder-only
    output (`sequences`, `scores`, `logits`, `past_key_values`) plus the call's `speculative_stats`
    (`GenerationStats`: tau, per-position acceptance, time split, tree sizes).

    For a batch (or padded prompts) `speculative_stats` pools the rounds of every row and `row_stats` holds one
    `GenerationStats` per row (None for a single unpadded prompt). A batch's verification forward is shared: each row
    is charged an equal part of its time."""

    speculative_stats: GenerationStats | None = None
    row_stats: list[GenerationStats] | None = None
