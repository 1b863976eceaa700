"""The PosS draft models vLLM runs (see the package docstring for the design).

`PosSEagleForCausalLM`: EAGLE-1/2-style PosS drafters (method "eagle"). `PosSEagle3LlamaForCausalLM`: EAGLE-3-style
PosS drafters (method "eagle3"). Both keep one vLLM decoder layer per specialist (each with its own attention layer,
so its own KV cache) and pick, per call, the specialist of the draft position the proposer is drafting.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import LlamaDecoderLayer as Eagle3DecoderLayer
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix

from . import PosSServingError, check_vllm_version
from .config import (check_engine_mode, check_target, check_weights, position_groups, safetensors_names,
                     specialist_for_position)

# Checkpoint (transformers) projection names -> (vLLM fused parameter, shard id).
_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class _EagleSpecialist(LlamaDecoderLayer):
    """The target family's decoder layer without the norm before attention (EAGLE-1/2, HASS, PosS)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, config) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config)
        del self.input_layernorm
        self.input_layernorm = nn.Identity()

    def get_quant_config(self, vllm_config: VllmConfig):
        return get_draft_quant_config(vllm_config)

    def specialist_forward(self, positions: torch.Tensor, layer_inputs: torch.Tensor) -> torch.Tensor:
        # vLLM's fused add-norm may work in place on the residual: give it a copy, the inputs serve every specialist.
        hidden, residual = self.forward(positions, layer_inputs.clone(), None)
        return hidden + residual


class _PosSBase:
    """What both PosS model classes share: settings, checks, the draft-step plan, weight loading."""

    is_poss_drafter = True
    has_own_embed_tokens = False  # vLLM shares the target's embedding (`_maybe_share_embeddings`)

    def _poss_init(self, vllm_config: VllmConfig, drafter_type: str) -> dict:
        check_vllm_version()
        speculative = vllm_config.speculative_config
        self.config = speculative.draft_model_config.hf_config
        poss = getattr(self.config, "poss", None)
        if not isinstance(poss, dict):
            raise PosSServingError("The draft model config has no `poss` block: export the drafter with "
                                   "`poss export --format vllm`")
        if speculative.method != drafter_type:
            raise PosSServingError(
                f"This PosS drafter is {drafter_type!r}-style: serve it with speculative method {drafter_type!r}, "
                f"not {speculative.method!r}"
            )
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        check_engine_mode(vllm_config, is_breakable_cudagraph_enabled())
        check_target(poss, vllm_config.model_config.hf_config)
        self.weights_path = check_weights(speculative.draft_model_config.model, poss)
        self.poss = poss
        # One key/value list for every specialist (the PosS authors' PosS-on-EAGLE-3 training, `shared_context_kv`):
        # the context's keys/values are specialist 0's, each draft step adds those of the specialist that drafts it.
        self.shared_kv = bool(poss.get("shared_context_kv"))
        self.num_specialists = poss["num_specialists"]
        self.position_groups = position_groups(poss)
        # Specialists 0 .. drafting - 1 serve positions 1 .. K; later ones would only write KV nobody reads.
        self.drafting_specialists = self.specialist_for_position(speculative.num_speculative_tokens) + 1
        self._draft_index: int | None = None
        # Per-specialist call counts (tests and benchmarks read them through `specialist_calls`).
        self.specialist_calls = [0] * self.num_specialists
        return poss

    # ---- which specialist drafts this call ---------------------------------------------------------------------
    def set_draft_index(self, draft_index: int) -> None:
        """Called by the wrapped proposer before each draft-model call: 0 = draft position 1, i = position i + 1."""
        self._draft_index = int(draft_index)

    def specialist_for_position(self, position: int) -> int:
        return specialist_for_position(position, self.position_groups)

    def _plan(self) -> tuple[int, range]:
        """(specialist whose output this call returns, specialists that run): the first pass runs every specialist
        that drafts at K = num_speculative_tokens, draft step i its position's specialist and the later ones of
        those (they write their KV for the steps to come)."""
        index, self._draft_index = self._draft_index, None
        if index is None:
            context = get_forward_context() if is_forward_context_available() else None
            if context is None or context.attn_metadata is None:  # vLLM's dummy/profiling runs
                return 0, range(self.drafting_specialists)
            raise RuntimeError(
                "poss_vllm: a draft-model call without a draft index (the wrapped SpecDecodeBaseProposer."
                "build_per_group_and_layer_attn_metadata was not called before it)"
            )
        used = self.specialist_for_position(index + 1)
        if self.shared_kv:  # one cache: only the drafting specialist writes to it
            return used, range(used, used + 1)
        return used, range(0 if index == 0 else used, self.drafting_specialists)

    def _share_attention(self) -> None:
        """With a shared key/value list, every specialist's attention reads and writes specialist 0's KV cache: its
        vLLM `Attention` (the cache's owner; the other specialists keep their projections, norms and MLP)."""
        if self.shared_kv:
            shared = self.model.layers[0].self_attn.attn
            for layer in self.model.layers[1:]:
                layer.self_attn.attn = shared

    # ---- weights --------------------------------------------------------------------------------------------------
    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], rename) -> set[str]:
        """Load `weights` (native drafter names) through `rename(name) -> (vLLM name, shard id) | None`."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded, expected_sources = set(), set(safetensors_names(self.weights_path))
        seen = set()
        for name, tensor in weights:
            seen.add(name)
            target = rename(name)
            if target is None:
                raise PosSServingError(f"Unexpected tensor {name!r} in {self.weights_path}: not a PosS drafter export "
                                       "this plugin knows")
            vllm_name, shard = target
            if vllm_name in buffers:
                buffers[vllm_name].copy_(tensor.to(buffers[vllm_name].dtype))
                continue
            param = params[vllm_name]
            loader = getattr(param, "weight_loader", None)
            if shard is not None:
                loader(param, tensor, shard)
            elif loader is not None:
                loader(param, tensor)
            else:
                if param.shape != tensor.shape:
                    raise PosSServingError(f"{name}: shape {tuple(tensor.shape)} in {self.weights_path}, "
                                           f"{tuple(param.shape)} expected")
                param.data.copy_(tensor)
            loaded.add(vllm_name)
        missing = sorted(expected_sources - seen)
        not_loaded = sorted(set(params) - loaded)
        if missing or not_loaded:
            raise PosSServingError(f"{self.weights_path} lacks tensors for {not_loaded or missing}: export it again")
        return loaded


def _layer_rename(name: str, prefix: str = "specialists.") -> tuple[str, object] | None:
    """`specialists.{s}.self_attn.q_proj.weight` -> (`model.layers.{s}.self_attn.qkv_proj.weight`, "q")."""
    if not name.startswith(prefix):
        return None
    rest = "model.layers." + name[len(prefix):]
    for source, (fused, shard) in _STACKED.items():
        if f".{source}." in rest:
            return rest.replace(f".{source}.", f".{fused}."), shard
    return rest, None


class _SpecialistStack(nn.Module):
    """`model`: the shared fc, the specialists (and, for EAGLE-3, the final norm); vLLM sets `embed_tokens`."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.embed_tokens = _EmbeddingPlaceholder(hidden_size)


class _EmbeddingPlaceholder(nn.Module):
    """Stands where vLLM puts the target's embedding after loading (`_maybe_share_embeddings` compares widths)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.empty(0, hidden_size)  # a plain attribute: no parameter to load

    def forward(self, input_ids):
        raise RuntimeError("poss_vllm: the target's embedding was not shared with the drafter")


class PosSEagleForCausalLM(_PosSBase, EagleLlamaForCausalLM):
    """EAGLE-1/2-style PosS drafter: `fc(concat(embed(x_{t+1}), f_t))`, then the position's specialist."""

    has_own_lm_head = False  # vLLM shares the target's lm_head: its rows are the mapped draft-head rows

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        poss = self._poss_init(vllm_config, "eagle")
        config = self.config
        hidden = config.hidden_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.model = _SpecialistStack(hidden)
        self.model.fc = nn.Linear(2 * hidden, hidden, bias=bool(poss.get("fc_bias", True)))
        self.model.layers = nn.ModuleList(
            _EagleSpecialist(vllm_config, maybe_prefix(prefix, f"model.layers.{target_layers + s}"), config)
            for s in range(self.num_specialists)
        )
        self._share_attention()
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        draft_vocab = poss.get("draft_vocab_size")
        self.draft_vocab_size = draft_vocab
        self.draft_lm_head = self.draft_head_map = None
        if draft_vocab:
            own = poss.get("draft_head_rows")
            self.own_rows = draft_vocab if own is None else own
            self.draft_lm_head = nn.Linear(hidden, self.own_rows, bias=False)
            if self.own_rows < draft_vocab:
                self.draft_head_map = nn.Linear(hidden, hidden + 1, bias=False)
            self.register_buffer("draft_to_target", torch.arange(draft_vocab, dtype=torch.long))
        self._mapped = None  # (lm_head weight, gathered rows)

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        layer_inputs = self.model.fc(torch.cat((embeds, hidden_states.to(embeds.dtype)), dim=-1))
        used, run = self._plan()
        output = None
        for s in run:
            predicted = self.model.layers[s].specialist_forward(positions, layer_inputs)
            self.specialist_calls[s] += 1
            if s == used:
                output = predicted
        return output, output

    def _mapped_rows(self) -> torch.Tensor:
        """The target lm_head rows of the draft tokens after the drafter's own rows (gathered once)."""
        weight = self.lm_head.weight
        if self._mapped is None or self._mapped[0] is not weight:
            rows = weight.detach()[self.draft_to_target[self.own_rows:].to(weight.device)]
            self._mapped = (weight, rows.to(self.model.fc.weight.dtype).contiguous())
        return self._mapped[1]

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the reduced draft vocabulary `[N, Vd]` (the library's `PosSDrafter.logits`)."""
        own = self.draft_lm_head(hidden_states)
        if self.draft_head_map is None:
            return own
        mapped = self.draft_head_map(hidden_states)
        rows = self._mapped_rows()
        return torch.cat((own, mapped[:, :-1] @ rows.T + mapped[:, -1:]), dim=-1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.draft_lm_head is None:  # the full target vocabulary through the target's lm_head
            weight = self.lm_head.weight
            return (hidden_states.to(weight.dtype) @ weight.T)[:, : self.target_vocab_size]
        draft = self.draft_logits(hidden_states)
        logits = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name):
            if name in ("fc.weight", "fc.bias"):
                return "model." + name, None
            if name.startswith(("draft_lm_head.", "draft_head_map.")) or name == "draft_to_target":
                return name, None
            return _layer_rename(name)

        return self._load(weights, rename)


class PosSEagle3LlamaForCausalLM(_PosSBase, Eagle3LlamaForCausalLM):
    """EAGLE-3-style PosS drafter: `fc` over the target's fused states, one EAGLE-3 layer per group of positions,
    a shared final norm and the drafter's own head over its draft vocabulary."""

    has_own_lm_head = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        poss = self._poss_init(vllm_config, "eagle3")
        config = self.config
        hidden = config.hidden_size
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = target_layers
        aux = list(getattr(config, "eagle_aux_hidden_state_layer_ids", None) or [])
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.model = _SpecialistStack(hidden)
        self.model.use_aux_hidden_state = True
        self.model.norm_before_fc = False
        self.model.input_norm = None
        self.model.fc_norm = None
        self.model.num_aux_hidden_states = len(aux)
        self.model.fc_input_size = target_hidden * len(aux)
        self.model.fc = nn.Linear(self.model.fc_input_size, hidden, bias=bool(poss.get("fc_bias", False)))
        self.model.layers = nn.ModuleList(
            Eagle3DecoderLayer(vllm_config, prefix=maybe_prefix(prefix, f"model.layers.{target_layers + s}"),
                               config=config, layer_idx=0)
            for s in range(self.num_specialists)
        )
        self._share_attention()
        self.model.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        self.use_parallel_drafting = False
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size, dtype=torch.long))

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.fc(hidden_states.to(self.model.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        used, run = self._plan()
        output = None
        for s in run:
            hidden, residual = self.model.layers[s](positions=positions, embeds=embeds,
                                                    hidden_states=hidden_states.clone(), residual=None)
            self.specialist_calls[s] += 1
            if s == used:
                output = self.model.norm(hidden, residual)  # (normed for the head, pre-norm for the next step)
        return output

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(hidden_states)
        if draft.shape[-1] == self.target_vocab_size:
            return draft
        logits = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name):
            if name in ("fc.weight", "fc.bias", "norm.weight"):
                return "model." + name, None
            if name == "draft_lm_head.weight":
                return "lm_head.weight", None
            if name == "draft_to_target":
                return name, None
            return _layer_rename(name)

        return self._load(weights, rename)
