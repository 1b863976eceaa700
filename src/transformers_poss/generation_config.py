"""How a PosS drafter drafts: `PosSGenerationConfig`, the settings as the user or the drafter set them, and
`resolve_budget`, the one place where `generate` turns them into the budget it drafts with on a device kind."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from transformers import GenerationConfig

from .devices import local_device_kinds

DRAFT_MODES = ("tree", "chain")
SPECULATION_MODES = ("auto", "always")
# The settings whose value may depend on the device kind (`resolve_budget`).
BUDGET_KEYS = ("tree_depth", "tree_top_k", "tree_total_tokens", "lookup_num_tokens", "max_batch_size")
# The settings that make the tree budget: a kind without an entry warns unless the user set them all.
TREE_BUDGET_KEYS = ("tree_depth", "tree_top_k", "tree_total_tokens")
# The budget of a drafter that names none (`PosSGenerationConfig.default_budget`).
LIBRARY_DEFAULT_BUDGET = {"tree_depth": 6, "tree_top_k": 10, "tree_total_tokens": 60, "lookup_num_tokens": 0,
                          "max_batch_size": None}
# The smallest value of each integer setting (`max_batch_size` may also be None: no limit).
_MINIMUMS = {"tree_depth": 1, "tree_top_k": 1, "tree_total_tokens": 1, "lookup_num_tokens": 0, "max_batch_size": 0,
             "lookup_ngram_size": 2}
# Where a value `generate` uses comes from (`resolve_budget`); tuned entries say "tuned for KIND".
SET_BY_USER = "set by the user"
DRAFTER_DEFAULT = "the drafter's default"


def check_int(owner: str, name: str, value, minimum: int) -> None:
    """Raise `ValueError` unless `value` is an integer (not a bool) of at least `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_budget(owner: str, budget) -> None:
    """Raise `ValueError` unless `budget` is a dict of valid `BUDGET_KEYS` values (`max_batch_size` may be None)."""
    if not isinstance(budget, dict) or set(budget) - set(BUDGET_KEYS):
        raise ValueError(f"{owner} must be a dict of {BUDGET_KEYS}, got {budget!r}")
    for name, value in budget.items():
        if not (name == "max_batch_size" and value is None):
            check_int(owner, name, value, _MINIMUMS[name])


class PosSGenerationConfig(GenerationConfig):
    r"""How a PosS drafter drafts: `drafter.generation_config`, saved as `generation_config.json` beside `config.json`
    (where transformers keeps an assistant's `num_assistant_tokens`). It holds what was set, nothing more: the budget
    settings the user set, and the drafter's own budget (`default_budget`, and `device_budgets` tuned per device kind
    by `poss tune`). `generate` combines them for the kind it runs on in `resolve_budget`.

    Set a setting as on any generation config (`drafter.generation_config.tree_depth = 4`), or, for one call without
    changing the shared drafter, pass a view: `assistant_model=drafter.with_generation_config(tree_depth=4)`. Either
    way it is used on every device kind. The five budget settings (`BUDGET_KEYS`) are None until set: None takes the
    device kind's entry in `device_budgets`, else `default_budget`. Printing the config shows what is set;
    `describe_budget()` shows what a call on this machine drafts with.

    Args:
        draft_mode (`str`): `"tree"` (EAGLE-2 dynamic tree verified in one target forward, default) or `"chain"`
            (one path through transformers' own assisted-generation loop).
        tree_depth (`int`, *optional*): most draft positions per round; a round drafts fewer levels when deeper nodes
            could not enter its `tree_total_tokens` best (the tree is the same).
        tree_top_k (`int`, *optional*): children expanded per node and frontier width per depth.
        tree_total_tokens (`int`, *optional*): verified tree size, root included.
        lookup_num_tokens (`int`, *optional*): tree mode: the longest continuation copied from the context (prompt
            lookup) and grafted onto the draft tree as one more root path; `0` drafts with the specialists only.
            Verification keeps it lossless; it pays when answers repeat their prompt or themselves.
        max_batch_size (`int`, *optional*): the largest batch that `generate` drafts for; a larger one is decoded
            plainly (the same output) and `speculative_stats.plain_reason` says why. `0`: never draft (speculation
            does not pay). To draft at any batch size, set `speculation="always"`.
        lookup_ngram_size (`int`): the lookup matches the context's last `n` tokens, `n` from this down to 2, at
            their latest earlier occurrence.
        speculation (`str`): `"auto"` (default) follows `max_batch_size`; `"always"` drafts at any batch size, for
            one call: `assistant_model=drafter.with_generation_config(speculation="always")`.
        default_budget (`dict`): the drafter's budget on device kinds without a tuned entry: a value for each of
            `BUDGET_KEYS` (those not given: `LIBRARY_DEFAULT_BUDGET`'s; `max_batch_size` None: no limit).
        device_budgets (`dict`): the drafter's budget tuned per device kind (`transformers_poss.devices.device_kind`,
            e.g. `"cpu:avx2/float32"`): `{kind: {"tree_depth", "tree_top_k", "tree_total_tokens", "lookup_num_tokens",
            "max_batch_size"}}` (any of them), written by `poss tune`. Kinds without an entry draft with
            `default_budget` (with one warning naming `poss tune`, unless the user set the tree budget).
        kwargs: other `GenerationConfig` fields (unused by the drafter).
    """

    POSS_DEFAULTS = {
        "draft_mode": "tree", **dict.fromkeys(BUDGET_KEYS), "lookup_ngram_size": 3, "speculation": "auto",
        "default_budget": LIBRARY_DEFAULT_BUDGET, "device_budgets": {},
    }

    def __init__(self, **kwargs):
        for name, default in self.POSS_DEFAULTS.items():
            setattr(self, name, copy.deepcopy(kwargs.pop(name, default)))
        if isinstance(self.default_budget, dict):
            self.default_budget = {**LIBRARY_DEFAULT_BUDGET, **self.default_budget}
        super().__init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "PosSGenerationConfig":
        """`GenerationConfig.from_dict`. A dict without `default_budget` (a saved `generation_config.json`,
        `to_json_file`, or a drafter's settings given flat) holds the drafter's budget at the top level: it becomes
        `default_budget`, the budget settings staying unset."""
        if "default_budget" not in config_dict:
            config_dict = {name: value for name, value in config_dict.items() if name not in BUDGET_KEYS} | {
                "default_budget": {name: config_dict[name] for name in BUDGET_KEYS if name in config_dict}}
        return super().from_dict(config_dict, **kwargs)

    def to_json_file(self, json_file_path, use_diff: bool = True, keys_to_pop: list[str] | None = None) -> None:
        """`GenerationConfig.to_json_file` (what `save_pretrained` writes) in the format drafters are saved in: the
        drafter's budget at the top level, where what the user set becomes the saved drafter's own (used on every
        kind: the device entries lose it), so that the saved drafter drafts as this config does."""
        saved = json.loads(self.to_json_string(use_diff=use_diff, keys_to_pop=keys_to_pop))
        user = {name: saved[name] for name in BUDGET_KEYS if saved.get(name) is not None}
        saved.update({**saved.pop("default_budget"), **user})
        saved["device_budgets"] = {kind: {name: value for name, value in entry.items() if name not in user}
                                   for kind, entry in saved["device_budgets"].items()}
        Path(json_file_path).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @property
    def budget(self) -> dict:
        """The drafting settings as set (the `POSS_DEFAULTS` fields but `device_budgets`) as a dict."""
        return {name: getattr(self, name) for name in self.POSS_DEFAULTS if name != "device_budgets"}

    def describe_budget(self, kinds: list[str] | None = None) -> str:
        """What `generate` drafts with on each device kind of `kinds` (default: this machine's,
        `local_device_kinds`), one line per kind with each value's source."""
        lines = [f"What generate uses on {'this machine' if kinds is None else 'these device kinds'}:"]
        for kind in local_device_kinds() if kinds is None else kinds:
            budget, sources = resolve_budget(self, kind)
            untuned = "" if kind in self.device_budgets else " [no budget tuned for this kind: poss tune]"
            lines.append(f"  on {kind}: draft_mode={self.draft_mode}, "
                         + ", ".join(f"{name}={budget[name]} ({sources[name]})" for name in BUDGET_KEYS) + untuned)
        return "\n".join(lines)

    def plain_reason(self, kind: str, batch_size: int) -> str | None:
        """Why `generate` decodes a batch of `batch_size` plainly on device kind `kind` with these settings, or None
        to draft."""
        limit = resolve_budget(self, kind)[0]["max_batch_size"]
        if self.speculation == "always" or limit is None or batch_size <= limit:
            return None
        if limit == 0:
            return f"speculation does not pay on {kind} (max_batch_size 0, poss tune)"
        return (f"batch size {batch_size} is above max_batch_size {limit}, where speculation stops paying on {kind} "
                "(poss tune --batch-sizes)")

    def validate(self, *args, **kwargs):
        """`GenerationConfig.validate`, then raise `ValueError` on drafting settings no drafter can run with."""
        super().validate(*args, **kwargs)
        _check_budget("PosSGenerationConfig", {name: getattr(self, name) for name in BUDGET_KEYS
                                               if getattr(self, name) is not None})
        check_int("PosSGenerationConfig", "lookup_ngram_size", self.lookup_ngram_size, _MINIMUMS["lookup_ngram_size"])
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"PosSGenerationConfig.draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"PosSGenerationConfig.speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}"
            )
        _check_budget("PosSGenerationConfig.default_budget", self.default_budget)
        missing = [name for name in BUDGET_KEYS if name not in self.default_budget]
        if missing:
            raise ValueError(f"PosSGenerationConfig.default_budget lacks {missing}: it gives every kind its budget")
        if not isinstance(self.device_budgets, dict):
            raise ValueError(f"PosSGenerationConfig.device_budgets must be a dict, got {self.device_budgets!r}")
        for kind, entry in self.device_budgets.items():
            _check_budget(f"PosSGenerationConfig.device_budgets[{kind!r}]", entry)

    def updated(self, **settings) -> "PosSGenerationConfig":
        """A validated copy with drafting `settings` changed (they count as the user's: they apply on every device
        kind). Anything but the `POSS_DEFAULTS` fields raises `ValueError`: sampling and stopping settings belong to
        `generate`."""
        unknown = sorted(set(settings) - set(self.POSS_DEFAULTS))
        if unknown:
            generate_settings = [name for name in unknown if name in GenerationConfig().to_dict()]
            hint = (f" {generate_settings} are settings of generate() (sampling, length, stopping), not of drafting: "
                    f"pass them to target.generate(..., {generate_settings[0]}=...), which the drafter follows."
                    if generate_settings else "")
            raise ValueError(f"Unknown drafting settings {unknown}; PosS drafting settings are "
                             f"{list(self.POSS_DEFAULTS)}.{hint}")
        config = copy.deepcopy(self)
        config.update(**settings)
        return config


def resolve_budget(settings: PosSGenerationConfig, device_kind: str | None) -> tuple[dict, dict]:
    """The budget `generate` drafts with on `device_kind` and where each value comes from:
    `({name: value}, {name: source})` over `BUDGET_KEYS`. Each value is the one the user set (not None, source
    `SET_BY_USER`), else the kind's entry in `device_budgets` (`"tuned for KIND"`), else `default_budget`
    (`DRAFTER_DEFAULT`). `device_kind=None` stands for a kind without an entry."""
    entry = settings.device_budgets.get(device_kind) or {}
    budget, sources = {}, {}
    for name in BUDGET_KEYS:
        if getattr(settings, name) is not None:
            budget[name], sources[name] = getattr(settings, name), SET_BY_USER
        elif name in entry:
            budget[name], sources[name] = entry[name], f"tuned for {device_kind}"
        else:
            budget[name], sources[name] = settings.default_budget[name], DRAFTER_DEFAULT
    return budget, sources
