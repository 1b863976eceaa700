"""`PosSConfig`: everything needed to rebuild and run a PosS drafter."""

from __future__ import annotations

import copy

from transformers import AutoConfig, PretrainedConfig

# Target families whose decoder layer a drafter can be built from (the layer class comes from transformers).
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
DRAFT_MODES = ("tree", "chain")

# Keys of the target's text config that say nothing about one decoder layer (kept out of `target_config`).
_IRRELEVANT_TARGET_KEYS = (
    "architectures", "auto_map", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
    "id2label", "label2id", "task_specific_params", "quantization_config", "_commit_hash",
    "_attn_implementation_autoset", "output_hidden_states", "output_attentions", "return_dict",
)


class PosSConfig(PretrainedConfig):
    r"""Configuration of a PosS (Position Specialists) drafter.

    Args:
        target_config (`dict`):
            The target's text config (`target.config.get_text_config().to_dict()`): family (`model_type`),
            hidden size, heads, KV heads, head dim, intermediate size, RoPE parameters, norm eps, vocab size and
            whatever attention details the family needs. The drafter's layers are built from it.
        target_name_or_path (`str`, *optional*): the target the drafter was trained for (documentation, cards).
        num_specialists (`int`): number of position-specialist decoder layers.
        positions_per_specialist (`int`): draft positions each specialist serves ("PosS-k"); position `p`
            (1-based) uses specialist `min((p - 1) // k, num_specialists - 1)`. A single specialist is an
            EAGLE-2/HASS drafter.
        fc_bias (`bool`): whether the input projection `fc: 2H -> H` has a bias.
        specialist_intermediate_size (`int`, *optional*): MLP width of the specialist layers; `None` (default) is
            the target's `intermediate_size`. Wider specialists draft more slowly and may predict better;
            `warm_start` widens a trained drafter without changing what it computes.
        feature_layers (`list[int]`, *optional*): the target hidden states the drafter reads, as
            `output_hidden_states` indices (0: embeddings, `i`: after decoder layer `i`, `-1`: the final post-norm
            state), ending with `-1`. `None` (default) reads the final state only (EAGLE-1/2, HASS). More than one
            (EAGLE-3-style low/mid/high fusion, e.g. `[3, 16, -1]`) adds `fuse: Linear(n * H -> H)` over their
            concatenation; the drafter still predicts the final state, which deeper draft positions read.
        draft_mode (`str`): `"tree"` (EAGLE-2 dynamic tree, default) or `"chain"` (top-1 path through
            transformers' assisted-generation loop).
        tree_depth (`int`): draft positions per round.
        tree_top_k (`int`): children expanded per node and frontier width per depth.
        tree_total_tokens (`int`): verified tree size, root included.
        lookup_num_tokens (`int`): tree mode: the longest continuation copied from the context (prompt lookup) and
            grafted onto the draft tree as one more root path; `0` (default) drafts with the specialists only.
            Verification keeps it lossless; it pays when answers repeat their prompt or themselves.
        lookup_ngram_size (`int`): the lookup matches the context's last `n` tokens, `n` from this down to 2, at
            their latest earlier occurrence.
        draft_vocab_size (`int`, *optional*): size of a reduced draft vocabulary (a drafter-own `lm_head`
            over the most frequent target tokens); `None` drafts over the full target vocabulary.
        draft_head_rows (`int`, *optional*): with a draft vocabulary, how many of its rows (the first) the drafter
            stores and trains as its own; the other `draft_vocab_size - draft_head_rows` read the target's `lm_head`
            rows through a trained map `draft_head_map` (`(H + 1) * H` parameters for any number of rows), so a
            large draft vocabulary costs little to store. `None` (default) stores every row.
        training_record (`dict`, *optional*): data, steps, tokens and validation accuracy of training.
        tuning_record (`dict`, *optional*): what `poss tune` measured and predicted when it chose the tree budget.
    """

    model_type = "poss"

    target_config: dict | None = None
    target_name_or_path: str | None = None
    num_specialists: int = 1
    positions_per_specialist: int = 1
    fc_bias: bool = True
    specialist_intermediate_size: int | None = None
    feature_layers: list[int] | None = None
    draft_mode: str = "tree"
    tree_depth: int = 6
    tree_top_k: int = 10
    tree_total_tokens: int = 60
    lookup_num_tokens: int = 0
    lookup_ngram_size: int = 3
    draft_vocab_size: int | None = None
    draft_head_rows: int | None = None
    training_record: dict | None = None
    tuning_record: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        self.target_config = {k: v for k, v in (self.target_config or {}).items() if k not in _IRRELEVANT_TARGET_KEYS}
        self.training_record = self.training_record or {}
        self.tuning_record = self.tuning_record or {}
        super().__post_init__(**kwargs)
        self.check_settings()

    # ---- facts about the target, read from `target_config` -------------------------------------------------
    @property
    def target_model_type(self) -> str | None:
        return self.target_config.get("model_type")

    @property
    def hidden_size(self) -> int | None:
        return self.target_config.get("hidden_size")

    @property
    def vocab_size(self) -> int | None:
        return self.target_config.get("vocab_size")

    @property
    def input_feature_layers(self) -> list[int]:
        """The `output_hidden_states` indices of the target features the drafter reads (`[-1]` by default)."""
        return list(self.feature_layers) if self.feature_layers else [-1]

    def specialist_for_position(self, position: int) -> int:
        """Index of the specialist that drafts 1-based draft `position` within a round."""
        if position < 1:
            raise ValueError(f"draft positions are 1-based, got {position}")
        return min((position - 1) // self.positions_per_specialist, self.num_specialists - 1)

    def layer_config(self) -> PretrainedConfig:
        """The target family's config for the drafter's `num_specialists` full-attention decoder layers."""
        fields = copy.deepcopy(self.target_config)
        model_type = fields.pop("model_type")
        fields["num_hidden_layers"] = self.num_specialists
        if self.specialist_intermediate_size is not None:
            fields["intermediate_size"] = self.specialist_intermediate_size
        if "layer_types" in fields:  # drafter layers always attend to the whole context
            fields["layer_types"] = ["full_attention"] * self.num_specialists
        for key in ("sliding_window", "max_window_layers"):
            fields.pop(key, None)
        fields["use_sliding_window"] = False
        config = AutoConfig.for_model(model_type, **fields)
        config._attn_implementation = self._attn_implementation if self._attn_implementation else "sdpa"
        return config

    @property
    def own_draft_head_rows(self) -> int | None:
        """Rows of the draft head the drafter stores (`draft_head_rows`, or all of `draft_vocab_size`)."""
        return self.draft_vocab_size if self.draft_head_rows is None else self.draft_head_rows

    def check_settings(self) -> None:
        """Raise `ValueError` on settings no drafter can run with."""
        minimums = {
            "num_specialists": 1, "positions_per_specialist": 1, "tree_depth": 1, "tree_top_k": 1,
            "tree_total_tokens": 1, "lookup_num_tokens": 0, "lookup_ngram_size": 2,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"PosSConfig.{name} must be an integer >= {minimum}, got {value!r}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"PosSConfig.draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.draft_vocab_size is not None and (
            not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 1
            or (self.vocab_size is not None and self.draft_vocab_size > self.vocab_size)
        ):
            raise ValueError(
                f"PosSConfig.draft_vocab_size must be None or an integer in [1, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size!r}"
            )
        rows = self.draft_head_rows
        if rows is not None and (
            self.draft_vocab_size is None or not isinstance(rows, int) or isinstance(rows, bool)
            or not 0 <= rows <= self.draft_vocab_size
        ):
            raise ValueError(
                f"PosSConfig.draft_head_rows must be None or an integer in [0, draft_vocab_size="
                f"{self.draft_vocab_size}] (it needs a draft vocabulary), got {rows!r}"
            )
        width = self.specialist_intermediate_size
        if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
            raise ValueError(f"PosSConfig.specialist_intermediate_size must be None or an integer >= 1, got {width!r}")
        self._check_feature_layers()
        if self.target_config:
            family = self.target_config.get("model_type")
            if family not in SUPPORTED_FAMILIES:
                raise ValueError(
                    f"PosS drafters support target families {SUPPORTED_FAMILIES}; the target config says {family!r}"
                )
            for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
                if not self.target_config.get(key):
                    raise ValueError(f"PosSConfig.target_config lacks {key!r}: it cannot rebuild the drafter layers")

    def _check_feature_layers(self) -> None:
        layers = self.feature_layers
        if layers is None:
            return
        if (not isinstance(layers, (list, tuple)) or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
            raise ValueError(f"PosSConfig.feature_layers must be None or a list of integers, got {layers!r}")
        if layers[-1] != -1:
            raise ValueError(
                f"PosSConfig.feature_layers must end with -1 (the target's final hidden state, which the drafter "
                f"predicts), got {list(layers)}"
            )
        n_layers = (self.target_config or {}).get("num_hidden_layers")
        if n_layers:
            resolved = [i if i >= 0 else n_layers + 1 + i for i in layers]
            if any(not 0 <= i <= n_layers for i in resolved) or len(set(resolved)) != len(resolved):
                raise ValueError(
                    f"PosSConfig.feature_layers {list(layers)} must be distinct hidden-state indices of a target with "
                    f"{n_layers} layers (0 .. {n_layers}, or negative from -1)"
                )

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **kwargs) -> "PosSConfig":
        """Build a drafter config from a target model's config (its text config is copied)."""
        text_config = target_config.get_text_config()
        return cls(
            target_config=text_config.to_dict(),
            target_name_or_path=kwargs.pop("target_name_or_path", getattr(target_config, "_name_or_path", None)),
            **kwargs,
        )
