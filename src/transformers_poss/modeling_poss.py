"""`PosSDrafter`: a shared input projection and one decoder layer per group of draft positions (EAGLE-1/2, HASS and
PosS drafters; `PosSEagle3Drafter` is the EAGLE-3 kind).

The drafter reads the target's last hidden state (after the final norm) `f_t` and the embedding of the next token
`x_{t+1}`, and predicts `f_{t+1}`; the target's own `lm_head` (or a reduced draft head) turns predicted features
into logits. With `config.feature_layers`, the target's `f_t` is a learned fusion of several of its hidden states.
Its decoder layers are the target family's own transformers classes, without the norm before attention. The token
embedding and `lm_head` are the target's: a `BoundDrafter` (`drafter.bind(target)`) reads them for one call; they are
never held or saved by the drafter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.utils import ModelOutput

from . import kernels, layers, lora
from .binding import BoundDrafter
from .checkpoints import loading
from .configuration_poss import PosSConfig
from .generation_config import PosSGenerationConfig
from .layers import LEAN_FAMILIES, additive_mask, cache_length, causal_allowed, family_classes, select_hidden_states

# The model class of each config class (each drafter kind's model class adds itself when it is defined).
DRAFTER_MODELS: dict[type, type] = {}


@dataclass
class PosSDrafterOutput(ModelOutput):
    """
    Args:
        features (`torch.FloatTensor` of shape `(batch, seq, hidden)`): predicted next-position target features.
        logits (`torch.FloatTensor` of shape `(batch, seq, vocab)`, *optional*): draft logits of `features` (a
            `BoundDrafter` call with `return_logits=True`).
        cache (`DynamicCache`, *optional*): the drafter cache (one layer per specialist).
    """

    features: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: DynamicCache | None = None


class PosSPreTrainedModel(PreTrainedModel):
    config_class = PosSConfig
    base_model_prefix = "poss"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _supports_attention_backend = True
    _no_split_modules = []

    def _init_weights(self, module):
        std = self.config.target_config.get("initializer_range", 0.02)
        if module is getattr(self, "fuse", None):
            # Start as the last-layer-only drafter: pass the final hidden state through, ignore the others.
            hidden = module.weight.shape[0]
            with torch.no_grad():
                module.weight.zero_()
                module.weight[:, -hidden:] = torch.eye(hidden, dtype=module.weight.dtype)
        elif module is getattr(self, "draft_head_map", None):
            # Start as the target's own rows: m = [features, 0].
            with torch.no_grad():
                module.weight.zero_()
                module.weight[:-1] = torch.eye(module.weight.shape[1], dtype=module.weight.dtype)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif "RotaryEmbedding" in type(module).__name__:
            # Non-persistent RoPE buffers are not in checkpoints: recompute them (any family's layout of them).
            fresh = type(module)(config=module.config)
            with torch.no_grad():
                for name, buffer in fresh.named_buffers():
                    getattr(module, name).copy_(buffer)
        else:
            super()._init_weights(module)


class PosSDrafter(PosSPreTrainedModel):
    """PosS drafter: `fc(concat(embed(x_{t+1}), f_t))` then the specialist layer for the draft position.

    Attributes:
        fc: `Linear(2H -> H)`, shared by all specialists.
        fuse: only with several `config.feature_layers`: `Linear(nH -> H)` from the concatenated target hidden
            states to the feature space (initialised to pass the final state through).
        specialists: `num_specialists` decoder layers of the target family (input norm removed).
        draft_lm_head: only with `config.draft_vocab_size`: `Linear(H -> Vd)` over the draft vocabulary, whose
            token ids in the target vocabulary are the `draft_to_target` buffer; `Linear(H -> R)` over its first
            `R = config.draft_head_rows` tokens when that is set.
        draft_head_map: only with `config.draft_head_rows < config.draft_vocab_size`: `Linear(H -> H + 1)`, the
            rest of the draft vocabulary's logits: `E @ m[:H] + m[H]` for `m = draft_head_map(features)` and `E` the
            target's `lm_head` rows of those tokens `[Vd - R, H]` (an affine map of the target's rows, applied to
            the features instead).
        generation_config: how it drafts (`PosSGenerationConfig`: tree budget, prompt-lookup branch), saved as
            `generation_config.json`; `with_generation_config(...)` gives a view with other settings for one call.
        training_record / tuning_record: what training and `poss tune` measured (dicts, saved as
            `training_record.json` / `tuning_record.json` when not empty).
        int8_draft_weights: a kernel choice, not saved (like `attn_implementation`): the drafter's linear layers are
            `kernels.Int8Linear`s, which draft on the CPU with 8-bit weight copies (set by `from_pretrained(...,
            int8_draft_weights=True)` or assigned). Drafting streams half the bytes, for a little acceptance;
            verification keeps decoding lossless.
    """

    is_poss_drafter = True  # what the generate() hook dispatches on (not isinstance: remote code is another class)
    # Its outputs are predictions of the target's final hidden state (trained with a feature loss besides the tokens'),
    # which later draft positions read.
    predicts_target_features = True
    hub_pusher = None  # uploads a drafter with its model card (`hub.push_drafter_to_hub`, registered on import)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        DRAFTER_MODELS.setdefault(cls.config_class, cls)

    def __new__(cls, config=None, *args, **kwargs):
        """The model of `config`'s kind (`DRAFTER_MODELS`)."""
        if cls is PosSDrafter:
            cls = DRAFTER_MODELS.get(type(config), cls)
        return super().__new__(cls)

    def __init__(self, config: PosSConfig):
        super().__init__(config)
        layer_config = config.layer_config()
        self.build_layers(config, layer_config)
        self.rotary_emb = family_classes(config.layer_family)[1](config=layer_config)
        self.rope = layers.RotaryPositions(self.rotary_emb)
        self.draft_lm_head = self.draft_head_map = None
        if config.draft_vocab_size is not None:
            self.draft_lm_head = nn.Linear(config.hidden_size, config.own_draft_head_rows, bias=False)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size, dtype=torch.long))
            if config.own_draft_head_rows < config.draft_vocab_size:
                self.draft_head_map = nn.Linear(config.hidden_size, config.hidden_size + 1, bias=False)
        else:
            self.draft_to_target = None
        # The target's `lm_head` rows a `BoundDrafter` gathered for `draft_head_map` (`mapped_head_rows`), shared with
        # this drafter's views: the dict is filled in place, never replaced.
        self.head_rows_cache: dict[str, tuple] = {}
        self.generation_config = PosSGenerationConfig()
        self.training_record: dict = {}
        self.tuning_record: dict = {}
        self.post_init()
        if config.lora_rank is not None:  # after the initialisation: peft starts each adapter at zero (B = 0)
            lora.share_and_adapt(self.specialists, config)
            # State dicts hold the shared layer once, under specialist 0's names, however deep this module sits
            # (an accelerate checkpoint of a wrapper included).
            self.register_state_dict_post_hook(lora.drop_tied_entries)
            self.register_load_state_dict_pre_hook(lora.fill_tied_entries)

    def build_layers(self, config: PosSConfig, layer_config) -> None:
        """`fc`, `fuse` and the specialists: the target family's decoder layers without their input norm."""
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        n_states = config.num_fused_states
        self.fuse = nn.Linear(n_states * hidden, hidden, bias=False) if n_states > 1 else None
        self.norm = None  # no final norm before the head
        layer_class = family_classes(config.layer_family)[0]
        self.specialists = nn.ModuleList(layer_class(layer_config, layer_idx=i) for i in range(config.num_specialists))
        for layer in self.specialists:
            layer.input_layernorm = nn.Identity()
        # Layers whose inference forward `run_specialist` writes out (`layers.lean_attention`).
        self._lean_layers = config.layer_family in LEAN_FAMILIES

    # ---- construction, loading, saving ------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model: PreTrainedModel, num_specialists: int = 1, positions_per_specialist: int = 1,
                    **overrides) -> "PosSDrafter":
        """A freshly initialised drafter for `target_model`, on its `lm_head` device and dtype (its draft vocabulary,
        if any, the first `draft_vocab_size` tokens with the target's rows).

        `overrides` are `PosSConfig` fields (e.g. `draft_vocab_size`, `drafter_type`) and generation settings
        (`PosSGenerationConfig` fields, e.g. `tree_depth`: the new drafter's own budget), each sent where it belongs."""
        generation = {k: overrides.pop(k) for k in PosSGenerationConfig.POSS_DEFAULTS if k in overrides}
        config = PosSConfig.from_target_config(target_model.config, num_specialists=num_specialists,
                                               positions_per_specialist=positions_per_specialist, **overrides)
        drafter = cls(config)
        drafter.generation_config = PosSGenerationConfig.from_dict(generation)
        bound = drafter.bind(target_model)
        if drafter.draft_lm_head is not None:
            bound.init_draft_vocab(torch.arange(config.draft_vocab_size))
        return drafter

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, int8_draft_weights: bool | None = None,
                        merge_lora: bool = False, **kwargs):
        """Load a native drafter folder / Hub repo, or a checkpoint of another layout (EAGLE-1/2, HASS and PosS
        research checkpoints and EAGLE-3 ones, converted on load: `checkpoints.loading.load_drafter`).

        EAGLE-2-era PosS research checkpoints need `num_specialists` and `positions_per_specialist` unless their repo
        is a known preset. `int8_draft_weights=True` drafts with 8-bit weight copies on the CPU (default off). A
        drafter with LoRA specialists loads with its adapters, or merged into full layers with `merge_lora=True`."""
        drafter = loading.load_drafter(cls, pretrained_model_name_or_path, *model_args,
                                       load_native=super().from_pretrained, **kwargs)
        if merge_lora:
            drafter = drafter.merged()
        if int8_draft_weights is not None:
            drafter.int8_draft_weights = bool(int8_draft_weights)
        return drafter

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False,
                        **kwargs):
        """`PreTrainedModel.save_pretrained`, plus `generation_config.json`, the records and `custom_generate/`
        (`checkpoints.loading.save_drafter_files`). No model card: `push_to_hub`, `poss card` and `poss train` write
        it. With `push_to_hub=True` (and `repo_id`, default the folder's name) the folder is then uploaded with it."""
        if push_to_hub and is_main_process:
            return self.push_to_hub(kwargs.pop("repo_id", Path(save_directory).name),
                                    folder=save_directory, **kwargs)
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            loading.save_drafter_files(self, save_directory)
        return result

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the drafter with its model card (`hub.push_drafter_to_hub` for the options)."""
        if self.hub_pusher is None:
            raise RuntimeError("import transformers_poss to push a PosS drafter to the Hub")
        return type(self).hub_pusher(self, repo_id, **kwargs)

    def merged(self) -> "PosSDrafter":
        """This drafter with its LoRA specialists merged into full layers; itself when it has none."""
        return self if self.config.lora_rank is None else lora.merge_lora_specialists(self)

    def with_generation_config(self, **settings) -> "PosSDrafter":
        """A view of this drafter for one call (shared weights), with other generation settings (`PosSGenerationConfig`
        fields): `target.generate(..., assistant_model=drafter.with_generation_config(tree_depth=6))`."""
        view = copy.copy(self)  # shares parameters, buffers and submodules
        view.generation_config = self.generation_config.updated(**settings)
        return view

    def bind(self, target_model: PreTrainedModel, move: bool = True, generation_config=None) -> BoundDrafter:
        """This drafter drafting for `target_model` (`BoundDrafter`: reads its embedding and `lm_head`); with `move`
        the drafter goes beside the `lm_head` (device and dtype)."""
        return BoundDrafter(self, target_model, move=move, generation_config=generation_config)

    @property
    def int8_draft_weights(self) -> bool:
        return any(isinstance(module, kernels.Int8Linear) for module in self.modules())

    @int8_draft_weights.setter
    def int8_draft_weights(self, enabled: bool) -> None:
        kernels.use_int8_linears(self, bool(enabled))

    def init_draft_vocab(self, draft_to_target: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Set the draft vocabulary `[Vd]` (target ids), copy those rows of the target's `lm_head` weight `[V, H]` into
        the draft head and start `draft_head_map` as the identity: the draft logits are the target's over them."""
        ids = draft_to_target.to(device=self.fc.weight.device, dtype=torch.long)
        if self.draft_lm_head is None or ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"draft_to_target must have shape ({self.config.draft_vocab_size},), got {tuple(ids.shape)}")
        with torch.no_grad():
            self.draft_to_target.copy_(ids)
            weight = lm_head_weight.detach().dequantize()  # a weight-only quantized lm_head too
            own = ids[: self.config.own_draft_head_rows]
            self.draft_lm_head.weight.copy_(weight[own.to(weight.device)].to(self.draft_lm_head.weight))
        if self.draft_head_map is not None:
            self._init_weights(self.draft_head_map)

    # ---- the pieces of a forward -------------------------------------------------------------------------------
    @property
    def layer_input_size(self) -> int:
        """Width of `project`'s layer inputs (`config.layer_input_size`)."""
        return self.config.layer_input_size

    def attention_inputs(self, specialist: int, layer_inputs: torch.Tensor) -> torch.Tensor:
        """What `specialist`'s attention projections read from layer inputs `[..., layer_input_size]`."""
        return self.specialists[specialist].input_layernorm(layer_inputs)

    def target_features(self, hidden_states: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """What the drafter reads from a target forward run with `output_hidden_states=config.input_feature_layers`:
        the selected hidden states `[B, S, H]` each, concatenated to `[B, S, nH]`."""
        return select_hidden_states(hidden_states, self.config.input_feature_layers)

    def fuse_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., nH]` (see `target_features`) -> feature-space inputs `[..., H]`.

        The states before the final one are taken from the residual stream, whose scale varies by token and layer:
        each is RMS-normalised (no weight) before `fuse`. The final state is already normalised and passes as it is.
        """
        target_features = target_features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        if self.fuse is None:
            return target_features
        hidden = self.config.hidden_size
        lower, final = target_features[..., :-hidden], target_features[..., -hidden:]
        lower = lower.unflatten(-1, (-1, hidden))
        lower = nn.functional.rms_norm(lower.float(), (hidden,), eps=1e-6).to(final.dtype).flatten(-2)
        return self.fuse(torch.cat((lower, final), dim=-1))

    def project(self, inputs_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Layer inputs `fc(concat(inputs_embeds, features))`: `[B, S, H]`, `[B, S, H]` -> `[B, S, H]`."""
        features = features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        return self.fc(torch.cat((inputs_embeds, features), dim=-1))

    def run_specialist(
        self,
        specialist: int,
        layer_inputs: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        positions_below: int | None = None,
    ) -> torch.Tensor:
        """Run one specialist layer.

        Args:
            specialist: index in `[0, num_specialists)`.
            layer_inputs: `[B, S, layer_input_size]` outputs of `project`.
            position_ids: `[B, S]` target positions of the inputs.
            attention_mask: additive float `[B, 1, S, past + S]` (see `additive_mask`); `None` means causal.
            cache: drafter cache; layer `specialist` of it holds this specialist's past keys/values.
            positions_below: a bound on `position_ids` known without reading them (the draft session's): the RoPE
                cos/sin are then rows of a table instead of computed per call.
        Returns:
            predicted features `[B, S, H]`.
        """
        if not 0 <= specialist < len(self.specialists):
            raise IndexError(f"specialist {specialist} out of range [0, {len(self.specialists)})")
        if attention_mask is None:
            past = cache_length(cache, specialist)
            allowed = causal_allowed(layer_inputs.shape[1], past, layer_inputs.device)
            attention_mask = additive_mask(allowed, layer_inputs.dtype)
        position_embeddings = self.rope(layer_inputs, position_ids, positions_below)
        layer, attention_mask = self.specialists[specialist], attention_mask.to(layer_inputs.dtype)
        if self._lean_layers and layers.runs_lean(layer.self_attn):
            hidden = layer_inputs + layers.lean_attention(layer.self_attn, layer.input_layernorm(layer_inputs),
                                                   position_embeddings, attention_mask, cache)
            return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return layer(
            layer_inputs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )

    def logits(self, features: torch.Tensor, mapped_rows=None) -> torch.Tensor:
        """Logits of the drafter's own draft head `[..., H] -> [..., Vd]`; with `draft_head_map`, the rows after its
        own `R` come from `mapped_rows`: the target's `lm_head` rows `[Vd - R, H]`, or their `kernels.pack_int8` copy
        (values, scales). A drafter without a draft vocabulary has no head: `BoundDrafter.logits` reads the target's."""
        own = self.draft_lm_head(features)
        if self.draft_head_map is None:
            return own
        mapped = self.draft_head_map(features)  # [..., H + 1]
        mapped_features, mapped_bias = mapped[..., :-1], mapped[..., -1:]
        if isinstance(mapped_rows, tuple):
            mapped_logits = kernels.int8_product(mapped_features, *mapped_rows)
        else:
            mapped_logits = torch.matmul(mapped_features, mapped_rows.T)
        return torch.cat((own, mapped_logits + mapped_bias), dim=-1)

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Map indices into the draft logits' last dimension to target token ids."""
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def forward(self, inputs_embeds: torch.Tensor, features: torch.Tensor, specialist: int = 0,
                position_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: DynamicCache | None = None) -> PosSDrafterOutput:
        """Predict the next target features (training and drafting).

        Args:
            inputs_embeds: `[B, S, H]` the target's embeddings of the *next* token of each position (`x_{t+1}`).
            features: `[B, S, H]` target (or previously predicted) features `f_t`.
            specialist: which specialist layer to run.
            position_ids: `[B, S]`; defaults to `past + arange(S)`.
            attention_mask: additive float `[B, 1, S, past + S]`; `None` is causal.
            cache: optional `DynamicCache`, one layer per specialist.
        """
        if not inputs_embeds.is_floating_point():
            raise TypeError("PosSDrafter.forward takes the target's token embeddings; to run it on token ids, bind it "
                            "to its target: drafter.bind(target)(input_ids, features, ...)")
        if position_ids is None:
            past = cache_length(cache, specialist)
            position_ids = torch.arange(past, past + inputs_embeds.shape[1], device=self.fc.weight.device)[None]
            position_ids = position_ids.expand(inputs_embeds.shape[0], -1)
        layer_inputs = self.project(inputs_embeds, features)
        predicted = self.run_specialist(specialist, layer_inputs, position_ids, attention_mask, cache)
        return PosSDrafterOutput(features=predicted, cache=cache)


DRAFTER_MODELS[PosSConfig] = PosSDrafter
