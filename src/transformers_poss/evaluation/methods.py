"""Decoding methods the benchmark runs side by side, each one `target.generate(...)` call per turn."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..generation_config import resolve_budget

BASELINE = "baseline"
BUDGET_KEYS = ("tree_depth", "tree_top_k", "tree_total_tokens", "lookup_num_tokens")


@dataclass
class Method:
    """One way to call `target.generate`.

    Attributes:
        name: label in tables, JSON and plots.
        kind: `"baseline"` (plain generate), `"prompt_lookup"`, `"assistant"` (transformers assisted generation with
            a small model) or `"poss"`.
        generate_kwargs: extra keyword arguments for `generate` (e.g. `prompt_lookup_num_tokens`, `assistant_model`).
        drafter: the PosS drafter (kind `"poss"`); `mode` is its `draft_mode` for this method.
        overrides: drafting settings this method sets (`BUDGET_KEYS`); the calls pass the drafter with them
            (`drafter.with_generation_config`), leaving the drafter's own as they are. Settings not given are the
            drafter's for the device kind the target runs on.
        budget: the settings the calls draft with (`BUDGET_KEYS`), as reported.
    """

    name: str
    kind: str
    generate_kwargs: dict = field(default_factory=dict)
    drafter: object = None
    mode: str | None = None
    overrides: dict = field(default_factory=dict)
    budget: dict = field(default_factory=dict)
    source: str | None = None

    def __post_init__(self):
        if self.drafter is not None:  # one drafter serves several methods: each passes its own view of it
            self.generate_kwargs["assistant_model"] = self.drafter.with_generation_config(
                draft_mode=self.mode, **self.overrides
            )

    def call_kwargs(self) -> dict:
        kwargs = dict(self.generate_kwargs)
        if self.drafter is not None:  # the speculative statistics come back on the output
            kwargs["return_dict_in_generate"] = True
        return kwargs

    @property
    def depth(self) -> int | None:
        return self.budget.get("tree_depth") if self.drafter is not None else None

    def describe(self) -> dict:
        info = {"name": self.name, "kind": self.kind, "mode": self.mode, "source": self.source}
        info.update({k: v for k, v in self.generate_kwargs.items() if k != "assistant_model"})
        if self.drafter is not None:
            config = self.drafter.config
            info.update(self.budget)
            info.update(int8_draft_weights=self.drafter.int8_draft_weights, num_specialists=config.num_specialists,
                        positions_per_specialist=config.positions_per_specialist,
                        draft_vocab_size=config.draft_vocab_size)
        return info


def baseline_method() -> Method:
    return Method(BASELINE, "baseline", source="target.generate")


def prompt_lookup_method(num_tokens: int = 10) -> Method:
    if num_tokens < 1:
        raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {num_tokens}")
    return Method("prompt-lookup", "prompt_lookup", {"prompt_lookup_num_tokens": num_tokens},
                  source="transformers prompt lookup")


def assistant_method(assistant_model, name: str = "assistant", source: str | None = None) -> Method:
    return Method(name, "assistant", {"assistant_model": assistant_model}, source=source)


def poss_methods(name: str, drafter, modes=("tree", "chain"), source: str | None = None, device_kind: str | None = None,
                 **budget_overrides) -> list[Method]:
    """One method per draft mode for a PosS drafter: its generation config's settings for `device_kind` (the kind the
    target runs on; the default budget when None), where not overridden (an override of None keeps the drafter's)."""
    unknown = set(budget_overrides) - set(BUDGET_KEYS)
    if unknown:
        raise TypeError(f"unknown budget overrides {sorted(unknown)}; expected some of {BUDGET_KEYS}")
    overrides = {key: value for key, value in budget_overrides.items() if value is not None}
    resolved, _ = resolve_budget(drafter.generation_config.updated(**overrides), device_kind)
    budget = {key: resolved[key] for key in BUDGET_KEYS}
    methods = []
    for mode in modes:
        if mode not in ("tree", "chain"):
            raise ValueError(f"draft modes are 'tree' and 'chain', got {mode!r}")
        methods.append(Method(f"{name}-{mode}", "poss", drafter=drafter, mode=mode, overrides=dict(overrides),
                              budget=dict(budget), source=source))
    return methods
