"""Configuration of a PosS drafter: `PosSConfig`, what rebuilds its weights (how it drafts is its
`PosSGenerationConfig`, `generation_config`)."""

from __future__ import annotations

import copy

from transformers import AutoConfig, PretrainedConfig

from .generation_config import PosSGenerationConfig, check_int as _check_int

# Target families whose decoder layer a drafter is built from: family -> (transformers modeling module, decoder layer
# class, rotary embedding class). The classes are transformers' own (see `modeling_poss.family_classes`).
FAMILY_CLASSES = {
    "llama": ("llama", "LlamaDecoderLayer", "LlamaRotaryEmbedding"),
    "mistral": ("mistral", "MistralDecoderLayer", "MistralRotaryEmbedding"),
    "qwen2": ("qwen2", "Qwen2DecoderLayer", "Qwen2RotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3DecoderLayer", "Qwen3RotaryEmbedding"),
    "gemma3_text": ("gemma3", "Gemma3DecoderLayer", "Gemma3RotaryEmbedding"),
}
# The config class of each drafter kind (`drafter_type`, saved in config.json): "eagle" (EAGLE-1/2, HASS and PosS
# drafters) is `PosSConfig`, "eagle3" `PosSEagle3Config`; each kind's class adds itself when it is defined.
DRAFTER_CONFIGS: dict[str, type] = {}

# Keys of the target's text config that say nothing about one decoder layer (kept out of `target_config`).
_IRRELEVANT_TARGET_KEYS = (
    "architectures", "auto_map", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
    "id2label", "label2id", "task_specific_params", "quantization_config", "_commit_hash",
    "_attn_implementation_autoset", "output_hidden_states", "output_attentions", "return_dict",
)

# The target's special tokens, which a drafter's config reports from `target_config` (transformers' pipelines ask).
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The projections of a decoder layer that LoRA specialists adapt by default (every supported family names them so).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The records a drafter folder keeps beside `config.json` (`training_record.json`, `tuning_record.json`).
RECORD_NAMES = ("training_record", "tuning_record")


class PosSConfig(PretrainedConfig):
    r"""Configuration of a PosS (Position Specialists) drafter: what rebuilds its weights.

    How the drafter drafts (tree budget, prompt-lookup branch) is its `generation_config`, a `PosSGenerationConfig`;
    what its training and tuning measured are `training_record.json` / `tuning_record.json` beside `config.json`.

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
        position_groups (`list[int]`, *optional*): uneven groups instead: how many consecutive draft positions each
            specialist serves, one entry per specialist, e.g. `[1, 3, 4]`: position 1 alone, positions 2-4, then
            5 on (the last specialist serves every later position too). Overrides `positions_per_specialist`;
            `None` (default): `num_specialists` groups of `positions_per_specialist`.
        lora_rank (`int`, *optional*): LoRA specialists (`transformers_poss.lora`): the specialists share one
            layer's weights and each adds a peft LoRA adapter of this rank; `None` (default): full layers.
        lora_alpha (`int`, *optional*): the adapters' scale numerator (`alpha / rank`); default `2 * lora_rank`.
        lora_target_modules (`list[str]`, *optional*): the projections the adapters adapt; default all of them
            (`DEFAULT_LORA_TARGETS`).
        fc_bias (`bool`, *optional*): whether `fc` has a bias; default `True` (EAGLE research code; EAGLE-3 drafters,
            `PosSEagle3Config`, default to `False`).
        feature_layers (`list[int]`, *optional*): the target hidden states the drafter reads, as
            `output_hidden_states` indices (0: embeddings, `i`: after decoder layer `i`, `-1`: the final post-norm
            state), ending with `-1`. `None` (default) reads the final state only (EAGLE-1/2, HASS). More than one
            (low/mid/high fusion, e.g. `[3, 16, -1]`) adds `fuse: Linear(n * H -> H)` over their concatenation; the
            drafter still predicts the final state, which deeper draft positions read.
        draft_vocab_size (`int`, *optional*): size of a reduced draft vocabulary (a drafter-own `lm_head`
            over the most frequent target tokens); `None` drafts over the full target vocabulary.
        draft_head_rows (`int`, *optional*): with a draft vocabulary, how many of its rows (the first) the drafter
            stores and trains as its own; the other `draft_vocab_size - draft_head_rows` read the target's `lm_head`
            rows through a trained map `draft_head_map` (`(H + 1) * H` parameters for any number of rows), so a
            large draft vocabulary costs little to store. `None` (default) stores every row.
        drafter_type (`str`): the drafter kind, saved in config.json: `"eagle"` for this class (EAGLE-1/2, HASS, PosS);
            `PosSConfig(drafter_type="eagle3", ...)` and a config.json saying `"eagle3"` give a `PosSEagle3Config`.
        shared_context_kv (`bool`): the specialists share one key/value list, as the PosS authors' SpecForge fork
            trains its PosS-on-EAGLE-3 drafters: the context's keys/values are those of the specialist of draft
            position 1, and each draft level adds the keys/values of the specialist that drafts from it. `False`
            (default): every specialist attends to keys/values of the context and of earlier levels computed with
            its own weights. Set when such a checkpoint is read (`checkpoints.eagle3`); drafting and training follow
            it.
    """

    model_type = "poss"

    target_config: dict | None = None
    target_name_or_path: str | None = None
    num_specialists: int = 1
    positions_per_specialist: int = 1
    position_groups: list[int] | None = None
    lora_rank: int | None = None
    lora_alpha: int | None = None
    lora_target_modules: list[str] | None = None
    fc_bias: bool | None = None
    feature_layers: list[int] | None = None
    draft_vocab_size: int | None = None
    draft_head_rows: int | None = None
    drafter_type: str = "eagle"
    shared_context_kv: bool = False
    tie_word_embeddings: bool = False

    # Settings only another kind has; a config.json of this kind written before the kinds were split states them at
    # these values (dropped on reading; any other value is refused).
    _OTHER_KIND_DEFAULTS = {"norm_before_residual": False, "draft_layer_config": None}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        DRAFTER_CONFIGS.setdefault(cls.drafter_type, cls)

    def __new__(cls, *args, **kwargs):
        """The config of the kind `drafter_type` names (`DRAFTER_CONFIGS`): where a checkpoint's kind is decided."""
        if cls is PosSConfig:
            cls = DRAFTER_CONFIGS.get(kwargs.get("drafter_type", cls.drafter_type), cls)
        return super().__new__(cls)

    def __post_init__(self, **kwargs):
        misplaced = sorted(set(kwargs) & set(PosSGenerationConfig.POSS_DEFAULTS))
        if misplaced:
            raise ValueError(
                f"{misplaced} are drafting settings: they live in the drafter's `generation_config` "
                "(`PosSGenerationConfig`, saved as generation_config.json), not in `PosSConfig` / config.json"
            )
        self.target_config = {k: v for k, v in (self.target_config or {}).items() if k not in _IRRELEVANT_TARGET_KEYS}
        for name in SPECIAL_TOKEN_KEYS:  # read from `target_config` (properties); a config stating them keeps them
            if name in kwargs:
                self.target_config.setdefault(name, kwargs.pop(name))
        for name, default in self._OTHER_KIND_DEFAULTS.items():
            if name in kwargs and kwargs.pop(name) != default:
                raise ValueError(f"PosSConfig.{name} is an EAGLE-3 setting (drafter_type='eagle3')")
        self.fill_kind_defaults()
        if self.lora_rank is not None:
            self.lora_alpha = 2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha
            self.lora_target_modules = list(self.lora_target_modules or DEFAULT_LORA_TARGETS)
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

    # What transformers asks of an assistant's config (a pipeline compares them with its model's): the special tokens
    # of the target the drafter was trained for, as `target_config` records them (None where it does not).
    @property
    def bos_token_id(self) -> int | list[int] | None:
        return self.target_config.get("bos_token_id")

    @property
    def eos_token_id(self) -> int | list[int] | None:
        return self.target_config.get("eos_token_id")

    @property
    def pad_token_id(self) -> int | None:
        return self.target_config.get("pad_token_id")

    @property
    def input_feature_layers(self) -> list[int]:
        """The `output_hidden_states` indices of the target features the drafter reads, the final state (`-1`)
        last: `[-1]` by default, `feature_layers` for a fusing drafter."""
        return list(self.feature_layers) if self.feature_layers else [-1]

    @property
    def num_fused_states(self) -> int:
        """How many target hidden states the drafter's input fusion reads (`len(input_feature_layers)`)."""
        return len(self.input_feature_layers)

    @property
    def feature_layers_resolved(self) -> bool:
        """Whether the target layers read are known (always in this kind; see `resolve_feature_layers`)."""
        return True

    def resolve_feature_layers(self, num_target_layers: int) -> None:
        """Name the target layers read where the checkpoint left that to the target's depth (EAGLE-3 checkpoints do;
        this kind always names them)."""

    @property
    def layer_family(self) -> str | None:
        """The model family of the specialist layers: the target's."""
        return self.target_model_type

    @property
    def layer_input_size(self) -> int | None:
        """Width of a specialist's layer inputs (`PosSDrafter.project`): H."""
        return self.hidden_size

    def fill_kind_defaults(self) -> None:
        """Defaults this kind reads from the target (called once, before the checks)."""
        if self.fc_bias is None:
            self.fc_bias = True

    @property
    def group_sizes(self) -> list[int]:
        """Draft positions each specialist serves, in order: `position_groups`, or `num_specialists` times
        `positions_per_specialist`."""
        if self.position_groups is not None:
            return list(self.position_groups)
        return [self.positions_per_specialist] * self.num_specialists

    @property
    def has_uneven_groups(self) -> bool:
        return len(set(self.group_sizes)) > 1

    def describe_groups(self) -> str:
        """The position groups in words, e.g. `"1 | 2-4 | 5+"`."""
        parts, first = [], 1
        for index, size in enumerate(self.group_sizes):
            last = first + size - 1
            if index == len(self.group_sizes) - 1:
                parts.append(f"{first}+")
            else:
                parts.append(str(first) if size == 1 else f"{first}-{last}")
            first = last + 1
        return " | ".join(parts)

    def specialist_for_position(self, position: int) -> int:
        """Index of the specialist that drafts 1-based draft `position` within a round: the group holding it, the
        last specialist past the last group."""
        if position < 1:
            raise ValueError(f"draft positions are 1-based, got {position}")
        end = 0
        for index, size in enumerate(self.group_sizes):
            end += size
            if position <= end:
                return index
        return self.num_specialists - 1

    def check_groups_cover(self, depth: int) -> None:
        """Raise `ValueError` when explicit `position_groups` do not cover draft positions `1 .. depth` (training
        unrolls them: a later position would fall to the last specialist without being named)."""
        if self.position_groups is not None and sum(self.position_groups) < depth:
            raise ValueError(
                f"position_groups {list(self.position_groups)} cover draft positions 1..{sum(self.position_groups)}; "
                f"training unrolls {depth}: make the groups cover every trained position (e.g. a larger last group)"
            )

    def layer_config(self) -> PretrainedConfig:
        """The target family's config for the drafter's `num_specialists` full-attention decoder layers."""
        fields = copy.deepcopy(self.target_config)
        model_type = fields.pop("model_type")
        fields["num_hidden_layers"] = self.num_specialists
        if "layer_types" in fields:  # drafter layers always attend to the whole context
            fields["layer_types"] = ["full_attention"] * self.num_specialists
        for key in ("sliding_window", "max_window_layers"):
            fields.pop(key, None)
        fields["use_sliding_window"] = False
        return self._with_attention(AutoConfig.for_model(model_type, **fields))

    def _with_attention(self, layer_config: PretrainedConfig) -> PretrainedConfig:
        layer_config._attn_implementation = self._attn_implementation if self._attn_implementation else "sdpa"
        return layer_config

    @property
    def own_draft_head_rows(self) -> int | None:
        """Rows of the draft head the drafter stores (`draft_head_rows`, or all of `draft_vocab_size`)."""
        return self.draft_vocab_size if self.draft_head_rows is None else self.draft_head_rows

    def check_settings(self) -> None:
        """Raise `ValueError` on settings no drafter can be built with."""
        for name in ("num_specialists", "positions_per_specialist"):
            _check_int("PosSConfig", name, getattr(self, name), 1)
        groups = self.position_groups
        if groups is not None:
            if (not isinstance(groups, (list, tuple)) or not groups
                    or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in groups)):
                raise ValueError(f"PosSConfig.position_groups must be None or a list of integers >= 1, got {groups!r}")
            if len(groups) != self.num_specialists:
                raise ValueError(
                    f"PosSConfig.position_groups {list(groups)} names {len(groups)} groups for {self.num_specialists} "
                    "specialists: give one group size per specialist"
                )
            self.position_groups = list(groups)
        self._check_lora()
        if not isinstance(self.shared_context_kv, bool):
            raise ValueError(f"PosSConfig.shared_context_kv must be a bool, got {self.shared_context_kv!r}")
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
        if DRAFTER_CONFIGS.get(self.drafter_type) is not type(self):
            kinds = tuple(DRAFTER_CONFIGS)
            raise ValueError(f"PosSConfig.drafter_type must be one of {kinds}, got {self.drafter_type!r}")
        self._check_feature_layers()
        self.check_kind()

    def check_kind(self) -> None:
        """Raise `ValueError` on settings this kind cannot build: a supported target family, the layer sizes."""
        if self.target_config:
            family = self.target_config.get("model_type")
            if family not in FAMILY_CLASSES:
                raise ValueError(
                    f"PosS drafters support target families {tuple(FAMILY_CLASSES)}; the target config says {family!r}"
                )
            for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
                if not self.target_config.get(key):
                    raise ValueError(f"PosSConfig.target_config lacks {key!r}: it cannot rebuild the drafter layers")

    def _check_lora(self) -> None:
        if self.lora_rank is None:
            if self.lora_alpha is not None or self.lora_target_modules is not None:
                raise ValueError("PosSConfig.lora_alpha / lora_target_modules need lora_rank (LoRA specialists)")
            return
        _check_int("PosSConfig", "lora_rank", self.lora_rank, 1)
        _check_int("PosSConfig", "lora_alpha", self.lora_alpha, 1)
        if self.num_specialists < 2:
            raise ValueError("LoRA specialists (lora_rank) adapt one shared layer per position group: they need "
                             f"num_specialists >= 2, got {self.num_specialists}")
        unknown = sorted(set(self.lora_target_modules) - set(DEFAULT_LORA_TARGETS))
        if unknown or not self.lora_target_modules:
            raise ValueError(f"PosSConfig.lora_target_modules must be some of {DEFAULT_LORA_TARGETS}, got "
                             f"{self.lora_target_modules!r}")

    def _check_feature_layers(self) -> None:
        layers = self.feature_layers
        if layers is None:
            return
        if (not isinstance(layers, (list, tuple)) or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
            raise ValueError(f"PosSConfig.feature_layers must be None or a list of integers, got {layers!r}")
        self.check_feature_layer_list(layers)
        n_layers = (self.target_config or {}).get("num_hidden_layers")
        if n_layers:
            resolved = [i if i >= 0 else n_layers + 1 + i for i in self.input_feature_layers]
            if any(not 0 <= i <= n_layers for i in resolved) or len(set(resolved)) != len(resolved):
                raise ValueError(
                    f"PosSConfig.feature_layers {list(layers)} must be distinct hidden-state indices of a target with "
                    f"{n_layers} layers (0 .. {n_layers}, or negative from -1)"
                )

    def check_feature_layer_list(self, layers: list[int]) -> None:
        """Raise `ValueError` unless `feature_layers` suit this kind: ending with the final state (-1)."""
        if layers[-1] != -1:
            raise ValueError(
                f"PosSConfig.feature_layers must end with -1 (the target's final hidden state, which the drafter "
                f"predicts), got {list(layers)}"
            )

    @classmethod
    def feature_layers_of(cls, read_layers: list[int] | None) -> list[int] | None:
        """This kind's `feature_layers` for target features of hidden states `read_layers` (the final one, `-1`,
        last; `None`: the final one only): all of them."""
        return None if read_layers is None else list(read_layers)

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **kwargs) -> "PosSConfig":
        """Build a drafter config from a target model's config (its text config is copied)."""
        text_config = target_config.get_text_config()
        return cls(
            target_config=text_config.to_dict(),
            target_name_or_path=kwargs.pop("target_name_or_path", getattr(target_config, "_name_or_path", None)),
            **kwargs,
        )


DRAFTER_CONFIGS[PosSConfig.drafter_type] = PosSConfig
