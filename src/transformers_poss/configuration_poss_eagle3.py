"""Configuration of an EAGLE-3-style PosS drafter: `PosSEagle3Config`."""

from __future__ import annotations

import copy

from transformers import AutoConfig, PretrainedConfig

from .configuration_poss import PosSConfig

# Target hidden states an EAGLE-3 drafter fuses (low, mid, high) in every release.
EAGLE3_FUSED_STATES = 3
# Keys of a target's text config that an EAGLE-3 specialist (always a Llama layer, as in every EAGLE-3 release) reads.
EAGLE3_LAYER_KEYS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act",
    "initializer_range",
)


class PosSEagle3Config(PosSConfig):
    r"""Configuration of an EAGLE-3-style PosS drafter (`PosSEagle3Drafter`): `PosSConfig`'s fields, read as follows.

    The drafter reads the target hidden states `feature_layers` (low, mid, high; default `[2, L // 2, L - 3]` for a
    target of `L` layers, where `i` is the state entering decoder layer `i`), fuses them with `fc: nH -> H` (no bias
    by default: every EAGLE-3 reference, and vLLM, builds it without one), and each specialist is an EAGLE-3 layer:
    attention over `concat(norm(embedding), norm(hidden))` (2H) with the hidden state as the residual, then the MLP.
    It has its own final `norm` and draft head over a draft vocabulary (`draft_vocab_size`, the full vocabulary when
    unset); later draft positions read the specialist's own output before that norm. The target forward is asked for
    `feature_layers + [-1]` (`input_feature_layers`): the final state costs nothing there and gives training its
    target logits. A checkpoint that does not name its fused layers leaves `feature_layers` None until the drafter
    binds to its target, whose depth then gives the default (`resolve_feature_layers`).

    Args (besides `PosSConfig`'s):
        norm_before_residual (`bool`): the residual around attention is `hidden_norm(hidden)` instead of `hidden`
            (speculators' option; SafeAILab and SpecForge checkpoints use `False`).
        draft_layer_config (`dict`, *optional*): the Llama config of the specialist layers (heads, KV heads, head dim,
            MLP width, RMSNorm eps, RoPE); defaults to the target's values.
    """

    drafter_type: str = "eagle3"
    norm_before_residual: bool = False
    draft_layer_config: dict | None = None

    @property
    def input_feature_layers(self) -> list[int]:
        """`feature_layers + [-1]`: the fused states, then the final one (training's target logits)."""
        if self.feature_layers is None:
            raise ValueError(
                "This EAGLE-3 drafter's fused target layers are resolved from its target's depth when it binds to "
                "the target: call drafter.bind(target) (generate does) or pass target= when loading"
            )
        return [*self.feature_layers, -1]

    @property
    def num_fused_states(self) -> int:
        """How many target hidden states `fc` reads: `len(feature_layers)` (`EAGLE3_FUSED_STATES` while they are
        unresolved)."""
        return EAGLE3_FUSED_STATES if self.feature_layers is None else len(self.feature_layers)

    @property
    def feature_layers_resolved(self) -> bool:
        """Whether the fused layers are known (a checkpoint may leave them to the target's depth)."""
        return self.feature_layers is not None

    def resolve_feature_layers(self, num_target_layers: int) -> None:
        """Set the fused layers from the target's depth (`default_eagle3_feature_layers`) when the checkpoint did not
        name them; `ValueError` when that target cannot decide them."""
        if self.feature_layers is not None:
            return
        try:
            layers = default_eagle3_feature_layers(num_target_layers)
        except ValueError as error:
            raise ValueError(f"This EAGLE-3 drafter does not name the target layers it fuses: {error}") from None
        self.feature_layers = layers
        self.target_config["num_hidden_layers"] = num_target_layers

    @classmethod
    def feature_layers_of(cls, read_layers: list[int] | None) -> list[int] | None:
        """The states `fc` fuses: `read_layers` without the final one (read besides them)."""
        if read_layers is None:
            return None
        fused = [i for i in read_layers if i != -1]
        if not fused:
            raise ValueError("an EAGLE-3 drafter fuses low/mid/high target states: the features hold only the final "
                             "one; extract them with `poss features --feature-layers 2,L/2,L-3,-1` (L: target depth)")
        return fused

    @property
    def layer_family(self) -> str:
        """The specialists are Llama layers whatever the target's family."""
        return "llama"

    @property
    def layer_input_size(self) -> int | None:
        """Width of a specialist's layer inputs: 2H (embedding, hidden)."""
        return None if self.hidden_size is None else 2 * self.hidden_size

    def fill_kind_defaults(self) -> None:
        """The target's layer settings, its low/mid/high states, its vocabulary; `fc` without a bias."""
        if self.draft_layer_config is None and self.target_config:
            self.draft_layer_config = {k: self.target_config[k] for k in EAGLE3_LAYER_KEYS if k in self.target_config}
            if self.target_config.get("model_type") == "gemma3_text":  # gemma names its activation differently
                self.draft_layer_config["hidden_act"] = self.target_config.get("hidden_activation", "silu")
        n_layers = self.target_config.get("num_hidden_layers")
        if self.feature_layers is None and n_layers:
            self.feature_layers = default_eagle3_feature_layers(n_layers)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.fc_bias is None:
            self.fc_bias = False

    def layer_config(self) -> PretrainedConfig:
        """A Llama config of the `num_specialists` specialist layers, from `draft_layer_config`."""
        fields = {k: v for k, v in copy.deepcopy(self.draft_layer_config).items() if k != "model_type"}
        return self._with_attention(AutoConfig.for_model("llama", **fields, num_hidden_layers=self.num_specialists,
                                                         attention_bias=False, mlp_bias=False))

    def check_kind(self) -> None:
        for key in ("hidden_size", "vocab_size"):
            if not self.target_config.get(key):
                raise ValueError(f"PosSConfig.target_config lacks {key!r}: an EAGLE-3 drafter needs the target's {key}")
        if not self.draft_layer_config:
            raise ValueError("PosSConfig.draft_layer_config is required for an EAGLE-3 drafter (its layers' settings)")
        for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
            if not self.draft_layer_config.get(key):
                raise ValueError(f"PosSConfig.draft_layer_config lacks {key!r}: the EAGLE-3 layers cannot be built")
        if self.draft_layer_config["hidden_size"] != self.hidden_size:
            raise ValueError(
                f"EAGLE-3 layers of hidden_size {self.draft_layer_config['hidden_size']} cannot read the target's "
                f"embedding of hidden_size {self.hidden_size} (drafters with their own embedding are not supported)"
            )
        if self.draft_head_rows is not None:
            raise ValueError("PosSConfig.draft_head_rows maps target lm_head rows; EAGLE-3 drafters own their head")

    def check_feature_layer_list(self, layers: list[int]) -> None:
        """The states `fc` fuses, without the final one (always read besides them)."""
        if -1 in layers:
            raise ValueError(
                f"PosSConfig.feature_layers of an EAGLE-3 drafter name the states fc fuses; the final state (-1) "
                f"is always read besides them. Got {list(layers)}"
            )


def default_eagle3_feature_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high target states for a target of `num_hidden_layers` layers: the states entering
    decoder layers `2, L // 2, L - 3` (`output_hidden_states` indices; SafeAILab, SpecForge and vLLM agree)."""
    layers = [2, num_hidden_layers // 2, num_hidden_layers - 3]
    if not layers[0] < layers[1] < layers[2]:
        raise ValueError(
            f"EAGLE-3's default feature layers [2, L // 2, L - 3] need a target of at least 7 layers, this one has "
            f"{num_hidden_layers}: pass feature_layers"
        )
    return layers
