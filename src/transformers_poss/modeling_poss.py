"""`PosSDrafter`: a shared input projection and one decoder layer per group of draft positions.

The drafter reads the target's last hidden state (after the final norm) `f_t` and the embedding of the next token
`x_{t+1}`, and predicts `f_{t+1}`; the target's own `lm_head` (or a reduced draft head) turns predicted features
into logits. With `config.feature_layers`, the target's `f_t` is a learned fusion of several of its hidden states.
Its decoder layers are the target family's own transformers classes, without the norm before attention. The token
embedding and `lm_head` are the target's: they are bound by `bind_target` and never saved with the drafter.

With `config.drafter_type == "eagle3"` the drafter is an EAGLE-3 drafter (`Eagle3DecoderLayer` specialists, its own
final norm and draft head; see `PosSConfig`): the same methods, with layer inputs of width 2H (`layer_input_size`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.utils import ModelOutput

from .checkpoints.custom_generate import write_custom_generate
from .checkpoints.native import HUB_KWARGS, read_drafter_files
from .configuration_poss import RECORD_NAMES, PosSConfig
from .generation_config import PosSGenerationConfig
from . import kernels, layers, lora
from .kernels import DraftLinear, pack_int8, runs_int8
from .layers import (
    LEAN_FAMILIES, Eagle3DecoderLayer, additive_mask, cache_length, causal_allowed, family_classes, output_logits,
    select_hidden_states,
)


@dataclass
class PosSDrafterOutput(ModelOutput):
    """
    Args:
        features (`torch.FloatTensor` of shape `(batch, seq, hidden)`): predicted next-position target features.
        logits (`torch.FloatTensor` of shape `(batch, seq, vocab)`, *optional*): `lm_head(features)` over the draft
            vocabulary (the target vocabulary unless `config.draft_vocab_size` is set).
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
        fc: `Linear(2H -> H)`, shared by all specialists; for EAGLE-3, `Linear(nH -> H)` over the target's low/mid/high
            hidden states (`fuse_features`).
        fuse: only with several `config.feature_layers`: `Linear(nH -> H)` from the concatenated target hidden
            states to the feature space (initialised to pass the final state through).
        specialists: `num_specialists` decoder layers of the target family (input norm removed), or
            `Eagle3DecoderLayer`s.
        norm: EAGLE-3 only: the final RMSNorm before the draft head.
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
        int8_draft_weights: a kernel choice, not saved (like `attn_implementation`): on the CPU, `generate` drafts
            with 8-bit copies of the weights (`int8_weights`); set by `from_pretrained(..., int8_draft_weights=True)`
            or directly. Drafting streams half the bytes, for a little acceptance; verification keeps decoding
            lossless.
    """

    is_poss_drafter = True  # what the generate() hook dispatches on (not isinstance: remote code is another class)
    # Loaders of other checkpoint layouts, tried in order by `from_pretrained`: `reader(cls, path_or_id, **kwargs)`
    # returns a drafter, or None when the folder is not of its layout. Registered by `transformers_poss` on import
    # (`research_checkpoint`), so this module imports no loader.
    checkpoint_readers: list = []
    # Uploads a drafter with its model card (`hub.push_drafter_to_hub`, registered on import like the readers).
    hub_pusher = None

    def __init__(self, config: PosSConfig):
        super().__init__(config)
        layer_config = config.layer_config()
        layer_class, rotary_class = family_classes(config.layer_family)
        hidden = config.hidden_size
        if config.is_eagle3:
            self.fc = nn.Linear(config.num_fused_states * hidden, hidden, bias=config.fc_bias)
            self.fuse = None
            self.specialists = nn.ModuleList(Eagle3DecoderLayer(layer_config, i, config.norm_before_residual)
                                             for i in range(config.num_specialists))
            self.norm = LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps)
        else:
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
            n_feature_layers = config.num_fused_states
            self.fuse = nn.Linear(n_feature_layers * hidden, hidden, bias=False) if n_feature_layers > 1 else None
            self.specialists = nn.ModuleList(layer_class(layer_config, layer_idx=i)
                                             for i in range(config.num_specialists))
            for layer in self.specialists:
                layer.input_layernorm = nn.Identity()
            self.norm = None
        self.rotary_emb = rotary_class(config=layer_config)
        # Family layers whose inference forward `run_specialist` writes out (`lean_attention`); EAGLE-3 layers
        # take it inside their own forward.
        self._lean_layers = not config.is_eagle3 and config.layer_family in LEAN_FAMILIES
        self._rotary_takes_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        # RoPE from a table of positions (`_rope_rows`) where cos/sin depend on the position alone.
        self._rope_table_allowed = (not self._rotary_takes_layer_type
                                    and getattr(self.rotary_emb, "rope_type", "default") not in ("dynamic", "longrope"))
        self._rope_table = None
        self.draft_lm_head = self.draft_head_map = None
        if config.draft_vocab_size is not None:
            self.draft_lm_head = nn.Linear(hidden, config.own_draft_head_rows, bias=False)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size, dtype=torch.long))
            if config.own_draft_head_rows < config.draft_vocab_size:
                self.draft_head_map = nn.Linear(hidden, hidden + 1, bias=False)
        else:
            self.draft_to_target = None
        self._bound: dict[str, object] = {}
        # `mapped_head_rows`' gathered rows, shared with this drafter's views (`with_generation_config`), which
        # `generate` binds again on every call: the dict is filled in place, never replaced.
        self._head_rows_cache: dict[str, tuple] = {}
        self.generation_config = PosSGenerationConfig()
        self.training_record: dict = {}
        self.tuning_record: dict = {}
        for module in self.modules():  # the same parameters and state; only `forward` differs (`DraftLinear`)
            if type(module) is nn.Linear:
                module.__class__ = DraftLinear
        self._int8_head = False  # the mapped draft-head rows on 8 bits too (`int8_weights`)
        self.int8_draft_weights = False
        self.post_init()
        if config.lora_rank is not None:  # after the initialisation: peft starts each adapter at zero (B = 0)
            lora.share_and_adapt(self.specialists, config)
            # State dicts hold the shared layer once, under specialist 0's names, however deep this module sits
            # (an accelerate checkpoint of a wrapper included).
            self.register_state_dict_post_hook(lora.drop_tied_entries)
            self.register_load_state_dict_pre_hook(lora.fill_tied_entries)

    # ---- LoRA specialists ------------------------------------------------------------------------------------
    def merged(self) -> "PosSDrafter":
        """This drafter with its LoRA specialists merged into full layers (`lora.merge_lora_specialists`); itself
        when it has none."""
        return self if self.config.lora_rank is None else lora.merge_lora_specialists(self)

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_target(
        cls, target_model: PreTrainedModel, num_specialists: int = 1, positions_per_specialist: int = 1,
        **overrides,
    ) -> "PosSDrafter":
        """A freshly initialised drafter for `target_model`, bound to it, on its `lm_head` device and dtype.

        `overrides` are `PosSConfig` fields (e.g. `draft_vocab_size`) and generation settings (`PosSGenerationConfig`
        fields, e.g. `tree_depth`: the new drafter's own budget, its `default_budget`), each sent where it belongs."""
        generation = {k: overrides.pop(k) for k in PosSGenerationConfig.POSS_DEFAULTS if k in overrides}
        config = PosSConfig.from_target_config(
            target_model.config, num_specialists=num_specialists,
            positions_per_specialist=positions_per_specialist, **overrides,
        )
        drafter = cls(config)
        drafter.generation_config = PosSGenerationConfig.from_dict(generation)
        drafter.bind_target(target_model)
        if drafter.draft_lm_head is not None:
            drafter.init_draft_vocab(torch.arange(config.draft_vocab_size))
        return drafter

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *model_args, num_specialists: int | None = None,
        positions_per_specialist: int | None = None, int8_draft_weights: bool | None = None,
        merge_lora: bool = False, **kwargs,
    ):
        """Load a native drafter folder / Hub repo, or a checkpoint of another layout (`checkpoint_readers`: EAGLE-1/2,
        HASS and PosS research checkpoints, see `transformers_poss.checkpoints.research`, and EAGLE-3 ones, see
        `transformers_poss.checkpoints.eagle3`).

        Research checkpoints are converted on load; EAGLE-2-era PosS ones need `num_specialists` and
        `positions_per_specialist` unless their repo is a known preset (the authors' PosS-on-EAGLE-3 checkpoints name
        their class and load alone). A native folder's `generation_config.json`, `training_record.json` and
        `tuning_record.json` are read too. `int8_draft_weights=True` drafts with 8-bit weight copies on the CPU (the
        `int8_draft_weights` attribute; default off). A drafter with LoRA specialists (`transformers_poss.lora`) loads
        with its adapters, or merged into full specialist layers with `merge_lora=True`.
        """
        drafter = cls._load(pretrained_model_name_or_path, *model_args, num_specialists=num_specialists,
                            positions_per_specialist=positions_per_specialist, **kwargs)
        if merge_lora:
            drafter = drafter.merged()
        if int8_draft_weights is not None:
            drafter.int8_draft_weights = bool(int8_draft_weights)
        return drafter

    @classmethod
    def _load(cls, pretrained_model_name_or_path, *model_args, num_specialists=None, positions_per_specialist=None,
              **kwargs):
        if pretrained_model_name_or_path is not None:
            for reader in cls.checkpoint_readers:
                drafter = reader(
                    cls, pretrained_model_name_or_path, *model_args, num_specialists=num_specialists,
                    positions_per_specialist=positions_per_specialist, **kwargs,
                )
                if drafter is not None:
                    return drafter
        if num_specialists is not None or positions_per_specialist is not None:
            raise ValueError(
                "num_specialists / positions_per_specialist are read from a native drafter's config.json; they are "
                "only accepted for research-format (EAGLE/HASS/PosS) checkpoints"
            )
        drafter = cls._load_lora(pretrained_model_name_or_path, **kwargs)
        if drafter is None:
            drafter = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if pretrained_model_name_or_path is not None:
            hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
            files = read_drafter_files(pretrained_model_name_or_path, **hub_kwargs)
            drafter.generation_config = files.generation_config
            for key, record in files.records.items():
                setattr(drafter, key, record)
        return drafter

    @classmethod
    def _load_lora(cls, name_or_path, **kwargs) -> "PosSDrafter | None":
        """A native folder of a drafter with LoRA specialists, built from its config and filled with `load_state_dict`
        (transformers' loader would replace the shared parameters one by one and untie them); None for any other
        folder."""
        if name_or_path is None:
            return None
        hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
        config = kwargs.get("config")
        if not isinstance(config, PosSConfig):
            config = PosSConfig.from_pretrained(name_or_path, **hub_kwargs)
        if config.lora_rank is None:
            return None
        from safetensors.torch import load_file
        from transformers.utils import SAFE_WEIGHTS_NAME, cached_file

        tensors = load_file(cached_file(str(name_or_path), SAFE_WEIGHTS_NAME, **hub_kwargs))
        drafter = cls(config)
        dtype = kwargs.get("dtype")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        if isinstance(dtype, torch.dtype):
            drafter.to(dtype)
        else:
            drafter.to(next(t for t in tensors.values() if t.is_floating_point()).dtype)
        drafter.load_state_dict(tensors, strict=True)
        return drafter.eval()

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False,
                        **kwargs):
        """`PreTrainedModel.save_pretrained`, plus `generation_config.json`, the records (`training_record.json`,
        `tuning_record.json`, when not empty) and `custom_generate/` (`generate(custom_generate=FOLDER_OR_REPO,
        trust_remote_code=True)` drafts with this drafter: `checkpoints.custom_generate`). No model card:
        `push_to_hub`, `poss card` and `poss train` write it.

        With `push_to_hub=True` (and `repo_id`, default the folder's name, and `push_to_hub`'s options) the folder is
        then uploaded with its card, as `push_to_hub` does.
        """
        if push_to_hub and is_main_process:
            repo_id = kwargs.pop("repo_id", Path(save_directory).name)
            return self.push_to_hub(repo_id, folder=save_directory, **kwargs)
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            folder = Path(save_directory)
            self.generation_config.save_pretrained(folder)
            write_custom_generate(folder)
            for key in RECORD_NAMES:
                path = folder / f"{key}.json"
                if getattr(self, key):
                    path.write_text(json.dumps(getattr(self, key), indent=2, sort_keys=True) + "\n", encoding="utf-8")
                elif path.exists():  # a record of earlier weights does not describe these
                    path.unlink()
        return result

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the drafter with its model card (a README.md already in the repo is kept); see
        `transformers_poss.hub.push_drafter_to_hub` for the options."""
        if self.hub_pusher is None:
            raise RuntimeError("import transformers_poss to push a PosS drafter to the Hub")
        return type(self).hub_pusher(self, repo_id, **kwargs)

    def with_generation_config(self, **settings) -> "PosSDrafter":
        """A view of this drafter for one call, with other generation settings (`PosSGenerationConfig` fields,
        e.g. `tree_depth=4`); it shares the weights and leaves this drafter's own settings as they are::

            target.generate(**inputs, assistant_model=drafter.with_generation_config(tree_depth=6, tree_top_k=10))
        """
        return self.with_settings(self.generation_config.updated(**settings))

    def with_settings(self, generation_config: PosSGenerationConfig) -> "PosSDrafter":
        """A view of this drafter (shared weights) drafting with `generation_config`."""
        view = copy.copy(self)  # shares parameters, buffers and submodules
        view.generation_config = generation_config
        return view

    # ---- binding to a target -----------------------------------------------------------------------------------
    def check_compatible(self, target_model: PreTrainedModel) -> None:
        """Raise `ValueError` if this drafter was not built for a target shaped like `target_model`, or cannot draft
        for it losslessly (`layers.check_target_weights`: e.g. a target quantized with `quantize_dynamic`)."""
        layers.check_target_weights(target_model)
        target_config = target_model.config.get_text_config()
        expected = self.config.target_config
        facts = {
            "model_type (family)": (expected.get("model_type"), target_config.model_type),
            "hidden_size": (expected.get("hidden_size"), target_config.hidden_size),
            "vocab_size": (expected.get("vocab_size"), target_model.get_output_embeddings().weight.shape[0]),
        }
        if self.config.is_eagle3 and self.config.feature_layers is None:  # resolved by `bind_target`: can it be?
            copy.deepcopy(self.config).resolve_feature_layers(target_config.num_hidden_layers)
        if self.config.num_fused_states > 1:  # hidden-state indices name the same layers only at one depth
            facts["num_hidden_layers"] = (expected.get("num_hidden_layers"), target_config.num_hidden_layers)
        for name, (drafter_value, target_value) in facts.items():
            if drafter_value is None and self.config.is_eagle3:  # EAGLE-3 checkpoints need not name the family
                continue
            if drafter_value != target_value:
                raise ValueError(
                    f"This PosS drafter was built for a target with {name}={drafter_value!r}, but the target model "
                    f"has {name}={target_value!r}: use a drafter trained for this target"
                    f" ({self.config.target_name_or_path or 'unknown target'} is what this drafter names)."
                )

    def bind_target(self, target_model: PreTrainedModel, move: bool = True) -> "PosSDrafter":
        """Use `target_model`'s embedding and `lm_head`; move the drafter beside the `lm_head` (device and dtype). An
        EAGLE-3 drafter whose checkpoint did not name its fused target layers gets them from `target_model`'s depth."""
        self.check_compatible(target_model)
        self.config.resolve_feature_layers(target_model.config.get_text_config().num_hidden_layers)
        lm_head = target_model.get_output_embeddings()
        self._bound = {
            "target": target_model,
            "embed": target_model.get_input_embeddings(),
            "lm_head": lm_head,
        }
        if move:
            self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        return self

    @property
    def bound_target(self) -> PreTrainedModel | None:
        return self._bound.get("target")

    def _require_bound(self) -> None:
        if not self._bound:
            raise RuntimeError(
                "This PosSDrafter is not bound to a target: call `drafter.bind_target(target)` or pass it to "
                "`target.generate(..., assistant_model=drafter)`."
            )

    def init_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Set the draft vocabulary `[Vd]` (target ids), copy the matching rows of the target's `lm_head` into the
        draft head and start `draft_head_map` as the identity: the draft logits are the target's over those tokens."""
        self._require_bound()
        ids = draft_to_target.to(device=self.fc.weight.device, dtype=torch.long)
        if self.draft_lm_head is None or ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"draft_to_target must have shape ({self.config.draft_vocab_size},), got {tuple(ids.shape)}")
        with torch.no_grad():
            self.draft_to_target.copy_(ids)
            weight = self._bound["lm_head"].weight.detach().dequantize()  # a weight-only quantized lm_head too
            own = ids[: self.config.own_draft_head_rows]
            self.draft_lm_head.weight.copy_(weight[own.to(weight.device)].to(self.draft_lm_head.weight))
        if self.draft_head_map is not None:
            self._init_weights(self.draft_head_map)

    # ---- the pieces of a forward -------------------------------------------------------------------------------
    @property
    def layer_input_size(self) -> int:
        """Width of `project`'s layer inputs: H, or 2H (embedding, hidden) for an EAGLE-3 drafter."""
        return self.config.layer_input_size

    def attention_inputs(self, specialist: int, layer_inputs: torch.Tensor) -> torch.Tensor:
        """What `specialist`'s attention projections read from layer inputs `[..., layer_input_size]`."""
        layer = self.specialists[specialist]
        if self.config.is_eagle3:
            return layer.attention_inputs(layer_inputs)[0]
        return layer.input_layernorm(layer_inputs)

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Target token embeddings `[B, S] -> [B, S, H]`, on the drafter's device and dtype."""
        self._require_bound()
        embed = self._bound["embed"]
        return embed(input_ids.to(embed.weight.device)).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def target_features(self, hidden_states: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """What the drafter reads from a target forward run with `output_hidden_states=config.input_feature_layers`:
        the selected hidden states `[B, S, H]` each, concatenated to `[B, S, nH]` (`n = len(feature_layers)`)."""
        return select_hidden_states(hidden_states, self.config.input_feature_layers)

    def fuse_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., nH]` (see `target_features`) -> feature-space inputs `[..., H]`.

        EAGLE-3: `fc` over the `feature_layers` states (the final state, the last `H` columns, is not read).
        Otherwise the states before the final one are taken from the residual stream, whose scale varies by token and layer
        (SmolLM2-135M: RMS 3-10, single values up to 2.5e4 at layer 16): each is RMS-normalised (no weight) first.
        The final state is already normalised and passes as it is.
        """
        target_features = target_features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        hidden = self.config.hidden_size
        if self.config.is_eagle3:
            return self.fc(target_features[..., :-hidden])
        if self.fuse is None:
            return target_features
        lower, final = target_features[..., :-hidden], target_features[..., -hidden:]
        lower = lower.unflatten(-1, (-1, hidden))
        lower = nn.functional.rms_norm(lower.float(), (hidden,), eps=1e-6).to(final.dtype).flatten(-2)
        return self.fuse(torch.cat((lower, final), dim=-1))

    def project(self, input_ids: torch.LongTensor, features: torch.Tensor) -> torch.Tensor:
        """Layer inputs `fc(concat(embed(input_ids), features))`: `[B, S]`, `[B, S, H]` -> `[B, S, H]`; for EAGLE-3
        `concat(embed(input_ids), features)` `[B, S, 2H]` (the specialist normalises each half)."""
        features = features.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        joined = torch.cat((self.embed(input_ids), features), dim=-1)
        return joined if self.config.is_eagle3 else self.fc(joined)

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
        if positions_below is not None and self._rope_table_allowed:
            position_embeddings = self._rope_rows(layer_inputs, position_ids, positions_below)
        elif self._rotary_takes_layer_type:
            position_embeddings = self.rotary_emb(layer_inputs, position_ids, "full_attention")
        else:
            position_embeddings = self.rotary_emb(layer_inputs, position_ids)
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

    def _rope_rows(self, like: torch.Tensor, position_ids: torch.LongTensor, positions_below: int):
        """RoPE (cos, sin) `[B, S, D]` of `position_ids [B, S]` (all below `positions_below`) in `like`'s dtype, read
        from a table of positions `0 .. P - 1` the rotary module made (remade twice as long when too short)."""
        key = (like.dtype, like.device)
        table = self._rope_table
        if table is None or table[0] != key or table[1].shape[0] < positions_below:
            positions = torch.arange(max(2 * positions_below, 256), device=like.device)[None]
            cos, sin = self.rotary_emb(like, positions)
            table = self._rope_table = (key, cos[0], sin[0])
        return table[1][position_ids], table[2][position_ids]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits `[..., H] -> [..., V]` (target `lm_head`) or `[..., Vd]` with a draft vocabulary (after the
        final `norm` for EAGLE-3)."""
        if self.norm is not None:
            features = self.norm(features)
        if self.draft_head_map is not None:
            mapped = self.draft_head_map(features)  # [..., H + 1]
            mapped_features, mapped_bias = mapped[..., :-1], mapped[..., -1:]
            if self._int8_head and runs_int8(mapped_features, mapped_features.shape[-1]):
                mapped_logits = kernels.int8_product(mapped_features, *self.mapped_head_rows(int8=True))
            else:
                mapped_logits = torch.matmul(mapped_features, self.mapped_head_rows().T)  # rows [Vd - R, H]
            return torch.cat((self.draft_lm_head(features), mapped_logits + mapped_bias), dim=-1)
        if self.draft_lm_head is not None:
            return self.draft_lm_head(features)
        self._require_bound()
        return output_logits(self._bound["target"], features).to(features.device)

    def mapped_head_rows(self, int8: bool = False):
        """The target's `lm_head` rows `[Vd - R, H]` of the draft tokens after the drafter's own `R` rows, on the
        drafter's device and dtype (gathered once per `lm_head` weight and draft vocabulary, then reused by this
        drafter and its views, call after call); with `int8`, their `pack_int8` copy (values `[Vd - R, H]`, scales
        `[Vd - R]`)."""
        self._require_bound()
        weight = self._bound["lm_head"].weight
        ids = self.draft_to_target[self.config.own_draft_head_rows:]
        key = (weight.data_ptr(), weight._version, ids.data_ptr(), self.draft_to_target._version,
               self.fc.weight.device, self.fc.weight.dtype)
        cached = self._head_rows_cache.get("rows")  # (weight, key, rows, 8-bit copy or None)
        if cached is None or cached[0] is not weight or cached[1] != key:
            rows = weight.detach().dequantize()[ids.to(weight.device)]  # dequantize: a weight-only quantized lm_head
            rows = rows.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
            cached = self._head_rows_cache["rows"] = (weight, key, rows, None)
        if not int8:
            return cached[2]
        if cached[3] is None:
            cached = self._head_rows_cache["rows"] = (*cached[:3], pack_int8(cached[2]))
        return cached[3]

    @contextlib.contextmanager
    def int8_weights(self, enabled: bool = True):
        """Within the block, inference on the CPU multiplies with 8-bit copies of the drafter's weights (its linear
        layers, `DraftLinear`, and the mapped draft-head rows); what was set before is restored after it. The
        generation hook enters it for `self.int8_draft_weights`."""
        linears = [module for module in self.modules() if isinstance(module, DraftLinear)]
        previous = [layer.int8 for layer in linears], self._int8_head
        for layer in linears:
            layer.int8 = enabled
        self._int8_head = enabled
        try:
            yield self
        finally:
            for layer, state in zip(linears, previous[0]):
                layer.int8 = state
            self._int8_head = previous[1]

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Map indices into `logits(...)`'s last dimension to target token ids."""
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def forward(
        self,
        input_ids: torch.LongTensor,
        features: torch.Tensor,
        specialist: int = 0,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        return_logits: bool = False,
    ) -> PosSDrafterOutput:
        """Predict the next target features (training and drafting).

        Args:
            input_ids: `[B, S]` the *next* token of each position (`x_{t+1}`).
            features: `[B, S, H]` target (or previously predicted) features `f_t`.
            specialist: which specialist layer to run.
            position_ids: `[B, S]`; defaults to `past + arange(S)`.
            attention_mask: additive float `[B, 1, S, past + S]`; `None` is causal.
            cache: optional `DynamicCache`, one layer per specialist.
            return_logits: also return `logits(features)`.
        """
        if position_ids is None:
            past = cache_length(cache, specialist)
            position_ids = torch.arange(past, past + input_ids.shape[1], device=self.fc.weight.device)[None]
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        layer_inputs = self.project(input_ids, features)
        predicted = self.run_specialist(specialist, layer_inputs, position_ids, attention_mask, cache)
        return PosSDrafterOutput(
            features=predicted, logits=self.logits(predicted) if return_logits else None, cache=cache
        )
