"""Load EAGLE-3 drafters (SafeAILab, SpecForge / SpecBundle, speculators, PosS on EAGLE-3) as native `PosSDrafter`s.

**Layouts.** One folder or Hub repo with `config.json` and one weights file (`model.safetensors` or
`pytorch_model.bin`). Tensor names and shapes (`H` hidden size, `V` target vocabulary, `Vd` draft vocabulary, `A`
heads x head dim, `K` KV heads x head dim, `I` MLP width, `n` fused target states, 3 in every release):

| | SafeAILab EAGLE-3 | SpecForge / SpecBundle | speculators (`speculators_model_type: eagle3`) | PosS on EAGLE-3 |
|---|---|---|---|---|
| layer prefix | `midlayer.` | `midlayer.` | `layers.0.` | `layers.{i}.` (or `midlayers.{i}.`), one per specialist |
| q / k / v | `[A, 2H]` / `[K, 2H]` / `[K, 2H]` | same | same | same, every layer |
| o, MLP | `o_proj [H, A]`, `gate/up [I, H]`, `down [H, I]` | same | same | same |
| norms | `input_layernorm`, `hidden_norm`, `post_attention_layernorm` `[H]` | same | same | same |
| fusion | `fc.weight [H, nH]`, no bias | same | same (old speculators builds: `fc.bias`) | same |
| head | `norm.weight [H]`, `lm_head.weight [Vd, H]` | same | same | same |
| vocab map | `d2t [Vd]` int64, `t2d [V]` bool | same | same | same |
| embedding | not saved (frozen, excluded) | not saved | `embed_tokens.weight [V, H]` may be saved | not saved |
| layer config | top level (a Llama config, `draft_vocab_size`) | top level, `LlamaForCausalLMEagle3` | `transformer_layer_config` | top level, `LlamaForCausalLMPosSEagle3` |
| residual | `hidden` | `hidden` | `norm_before_residual` | `hidden` |

Sources: SafeAILab/EAGLE `eagle/model/cnets.py` (`LlamaDecoderLayeremb`, `Model`: `fc` without bias, `norm`,
`lm_head`, `d2t`/`t2d` buffers, drafting with `topk_index + d2t[topk_index]`, later steps fed `out_hidden`, the
pre-norm output), `eagle/traineagle3/main.py` (`save_16bit_model(exclude_frozen_parameters=True)`: no embedding;
steps weighted `0.8 ** i`), `eagle/traineagle3/cnets.py` (`d2t[i] = used_tokens[i] - i`, `t2d` the mask of used
tokens; soft cross-entropy over the draft vocabulary masked where the target's top token is outside it),
`eagle/traineagle3/config.json` (no `rope_theta`: RoPE base 10000), `eagle/model/modeling_llama_kv.py` (the fused
states enter decoder layers `2, L // 2, L - 3`); sgl-project/SpecForge `specforge/modeling/draft/llama3_eagle.py`
(same layer, `midlayer`, `fc` without bias), `scripts/train_eagle3*.py` (checkpoints drop every `embed` key),
`configs/*-eagle3.json` (`LlamaForCausalLMEagle3`, Llama layer also for Qwen targets), `specforge/modeling/target/
eagle3_target_model.py` (outputs of layers `1, L // 2 - 1, L - 4`, i.e. the same states); vllm-project/speculators
`src/speculators/models/eagle3/config.py` and `core.py` (`transformer_layer_config`, `norm_before_residual`
default `False`, `eagle_aux_hidden_state_layer_ids`, `speculators_config.{proposal_methods, verifier}`),
`src/speculators/models/eagle3.py` (`Eagle3DecoderLayer`: with `norm_before_residual` the residual is
`hidden_norm(hidden)`); vllm-project/vllm `vllm/model_executor/models/llama_eagle3.py` (renames `midlayer.` to
`layers.0.`, `d2t` to `draft_id_to_target_id`, skips `t2d`, `fc` without bias, `target = arange(Vd) + d2t`; layers
after the first of a multi-layer (stacked) drafter read `H` and all run in sequence) and
`vllm/transformers_utils/configs/speculators/algos.py` (reads `norm_before_residual`, default `True` when absent).

**PosS on EAGLE-3** (`HINT-lab/PosS3-E3-Llama3.1-8B-Instruct`, trained with the authors' SpecForge fork in
shrango/PosS `specforge/`). Sources, all in shrango/PosS: `specforge/specforge/modeling/draft/llama3_poss_eagle.py`
(`LlamaForCausalLMPosSEagle3`: `layers`, a list of `(ttt_length - 1) // 3 + 1` EAGLE-3 layers whose q/k/v all read
`2H` (`midlayers` in the file's version at commit ae024e72), `fc` `3H -> H` without bias, `norm`, `lm_head [Vd, H]`,
`d2t`/`t2d` buffers; `pos_per_layer = 3 # fixed to 3`, `layer_select(forward_num) = forward_num // 3`; a hard
(1, 3, 4) split is commented out as "actually performs better", and is not what ran),
`specforge/specforge/core/poss_eagle3.py` (TTT step `idx`, 0-based, runs with `forward_num=idx`),
`specforge/scripts/train_poss_eagle3_online.py` (`--ttt-length` 7 by default; a checkpoint is
`draft_model.save_pretrained(dir, state_dict=...)` without `embed` keys, so `config.json` is the draft Llama config
with `architectures: ["LlamaForCausalLMPosSEagle3"]`, the class name `save_pretrained` writes; neither positions per
layer nor TTT length is saved), `specforge/run_llama3.1_poss_eagle3_online_mix_data.sh` (Llama-3.1-8B-Instruct,
`configs/llama3-8B-eagle3.json`, `--ttt-length 8`: 3 layers), and their vLLM fork:
`vllm/vllm/model_executor/models/registry.py` (`LlamaForCausalLMPosSEagle3` served by `Eagle3LlamaForCausalLM`),
`vllm/vllm/model_executor/models/llama_eagle3.py` (`num_hidden_layers` layers, each reading `2H`, loaded from
`layers.{i}.*`), `vllm/vllm/v1/spec_decode/eagle.py` (chain drafting; position 1 runs layer 0, draft step
`token_index` (position `token_index + 2`) runs `select_layer_idx(token_index) = (token_index + 1) // 3`, only when
the drafter's name contains "poss"), `vllm/run_vllm_eval.py` (7 draft tokens).

- Told apart from a stacked EAGLE-3 drafter by `architectures: ["LlamaForCausalLMPosSEagle3"]` and by its weights:
  every layer reads `2H`; a stacked drafter's later layers read `H` (refused: its layers run in sequence, not one per
  position). A folder of several `2H` layers without that architecture needs `positions_per_specialist`.
- Positions per specialist: `positions_per_specialist` from `config.json` when it is saved there, else the authors'
  fixed 3 for `LlamaForCausalLMPosSEagle3` (SpecForge saves no such key), else a known repo (`EAGLE3_PRESETS`).
- Position to layer: training's step `forward_num = p - 1` drafts position `p` with layer `(p - 1) // 3`, and so does
  their vLLM port (`(token_index + 1) // 3` with `token_index = p - 2`): the two agree. The native
  `PosSConfig.specialist_for_position(p) = min((p - 1) // k, n - 1)` is that mapping for every trained position
  `p <= 3n`; later positions, which no layer was trained for (training would index past its layers, their vLLM port
  too), reuse the last layer.
- Keys and values as trained: their TTT (`core/poss_eagle3.py`, sdpa backend) keeps ONE key/value list
  `cache_hidden` for all layers: step 0 (layer 0) appends the keys/values of every position, which are the
  context's and are never recomputed; step `j` appends those its own layer `j // 3` computes from its inputs (the
  draft token and the previous step's pre-norm output, not detached); each layer has its own three norms, `fc`,
  the final `norm` and `lm_head` are shared. The converted config records this as `shared_context_kv=True`, which
  drafting and training follow (the native PosS semantics, keys/values of the context and of earlier levels with
  each specialist's own weights, is `False`). (Their vLLM port keeps one KV cache per layer and runs layers `> 0`
  on draft steps only, so those read context slots they never wrote.)
- RoPE as trained: the fork's attention (`LlamaAttention._init_rope` in `llama3_poss_eagle.py`) builds its rotary
  embedding with the default base 10000 whatever `config.json` says (`rope_theta` is never passed; the `llama3`
  scaling type maps to the same unscaled embedding), so these checkpoints load with base 10000 and no scaling
  (`configs/llama3-8B-eagle3.json`, which their Llama-3.1 run saves, says 500000 with `llama3` scaling).
- Their TTT also shifts the attention mask after each step (SafeAILab's EAGLE-3 training mask: step `j` of row `u`
  sees the context up to `u - j`, not `u`), which no drafting reproduces and this library's training does not
  either (tests/fixtures/reference/README.md).

**Conversion.** Layer `i` becomes `specialists.{i}` unchanged; `fc`, `norm` keep their names; `lm_head` becomes
`draft_lm_head`; the offsets `d2t` become absolute target ids `draft_to_target = arange(Vd) + d2t` (checked against
`t2d`); a stored embedding is dropped (the target's is used; with `target=` it must equal the target's). The fused
states are `eagle_aux_hidden_state_layer_ids` when the config names them (speculators, newer SpecForge under
`eagle_config`), else EAGLE-3's default `[2, L // 2, L - 3]`, which needs the target's depth `L`: from `target=`
(a model or a local folder), `num_target_layers=`, or a known repo (`EAGLE3_PRESETS`); without any of them the
drafter loads all the same and takes `L` from the target it binds to (`generate` binds it). RoPE, heads, MLP width and
RMSNorm eps come from the drafter's own config (not the target's). Missing, extra or mis-shaped tensors, a stacked
drafter (layers after the first reading `H`, not `2H`), attention or MLP biases and layer types other than Llama are
refused with a `ValueError` before any weight is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..configuration_poss import PosSConfig
from ..configuration_poss_eagle3 import EAGLE3_LAYER_KEYS, PosSEagle3Config
from ..generation_config import PosSGenerationConfig
from ..modeling_poss import PosSDrafter
from ..modeling_poss_eagle3 import PosSEagle3Drafter
from .native import HUB_KWARGS
from .research import (
    _GENERATION_OVERRIDES, _LOAD_KWARGS, ResearchCheckpoint, _read_config, check_embedding_matches,
    read_research_checkpoint, target_input_embedding, tensor_problems,
)

_LLAMA_3_1_8B_INSTRUCT = "meta-llama/Llama-3.1-8B-Instruct"
# Hub repo id (lower case) -> (target, the target's num_hidden_layers, positions_per_specialist or None). These
# checkpoints name neither their target nor its depth, which EAGLE-3's default fused states depend on.
EAGLE3_PRESETS = {
    "yuhuili/eagle3-llama3.1-instruct-8b": (_LLAMA_3_1_8B_INSTRUCT, 32, None),
    "hint-lab/poss3-e3-llama3.1-8b-instruct": (_LLAMA_3_1_8B_INSTRUCT, 32, 3),
}
# What the authors' SpecForge fork saves (module docstring): the class name, and its fixed positions per layer.
POSS_EAGLE3_ARCHITECTURE = "LlamaForCausalLMPosSEagle3"
POSS_EAGLE3_POSITIONS_PER_LAYER = 3
POSS_EAGLE3_ROPE_THETA = 10000.0  # the fork's RoPE base, whatever config.json says (module docstring)
LAYOUT_NAMES = {
    "safeailab": "EAGLE-3 (SafeAILab)", "specforge": "EAGLE-3 (SpecForge / SpecBundle)",
    "speculators": "speculators (eagle3)", "poss_eagle3": "PosS on EAGLE-3",
}
_CONFIG_OVERRIDES = ("target_name_or_path", "feature_layers")
_LAYER_STEMS = ("midlayer", "midlayers", "layers")  # numbered layers: `{stem}.{i}.`


# ---- recognising --------------------------------------------------------------------------------------------------
def eagle3_config_layout(config: dict) -> str | None:
    """`"speculators"`, `"eagle3"` (SafeAILab / SpecForge / PosS on EAGLE-3, told apart by their weights) or None."""
    if config.get("speculators_model_type") is not None:
        return "speculators"
    architectures = config.get("architectures") or []
    if "draft_vocab_size" in config or any("eagle3" in str(a).lower() for a in architectures):
        return "eagle3"
    return None


def is_poss_eagle3_config(config: dict) -> bool:
    """Whether `config` names the authors' PosS-on-EAGLE-3 class (`architectures: [LlamaForCausalLMPosSEagle3]`)."""
    return POSS_EAGLE3_ARCHITECTURE in (config.get("architectures") or [])


def is_eagle3_checkpoint(path_or_id, **hub_kwargs) -> bool:
    config = _read_config(path_or_id, **hub_kwargs)
    return config is not None and config.get("model_type") != PosSConfig.model_type and \
        eagle3_config_layout(config) is not None


def _preset(source: str):
    text = str(source).replace("\\", "/").strip("/").lower()
    for name, preset in EAGLE3_PRESETS.items():
        if text == name or f"models--{name.replace('/', '--')}" in text:
            return preset
    return None


def layer_prefixes(state: dict) -> tuple[str, list[str]]:
    """`(stem, [prefix of layer i])` from the tensor names: one `midlayer.` (SafeAILab / SpecForge), or numbered
    `layers.{i}.` (speculators; PosS on EAGLE-3), `midlayers.{i}.` or `midlayer.{i}.` (PosS on EAGLE-3)."""
    keys = list(state)
    if any(k.startswith("midlayer.self_attn.") for k in keys):
        return "midlayer", ["midlayer."]
    for stem in _LAYER_STEMS:
        indices = sorted({int(k.split(".")[1]) for k in keys if k.startswith(stem + ".") and k.split(".")[1].isdigit()})
        if indices:
            if indices != list(range(len(indices))):
                raise ValueError(f"layers {indices} under '{stem}.' are not numbered 0 .. {len(indices) - 1}")
            return stem, [f"{stem}.{i}." for i in indices]
    raise ValueError("no EAGLE-3 layer weights ('midlayer.*', 'layers.{i}.*' or 'midlayers.{i}.*') found")


def stacked_layers(state: dict, prefixes: list[str], hidden_size: int) -> list[int]:
    """Indices of the layers after the first whose q_proj reads `H` (`[A, H]`, not `[A, 2H]`): a stacked EAGLE-3
    drafter's (its layers run in sequence), never a PosS one's."""
    return [i for i, prefix in enumerate(prefixes) if i > 0 and prefix + "self_attn.q_proj.weight" in state
            and state[prefix + "self_attn.q_proj.weight"].shape[-1] == hidden_size]


# ---- the native config ------------------------------------------------------------------------------------------
def _layer_fields(checkpoint: ResearchCheckpoint, speculators: bool, authors_rope: bool = False) -> dict:
    """The specialist layers' Llama config; with `authors_rope`, the RoPE the authors' fork trains with (module
    docstring) instead of the one `config.json` names."""
    raw = checkpoint.config.get("transformer_layer_config") if speculators else checkpoint.config
    if not isinstance(raw, dict):
        raise ValueError(f"{checkpoint.source}: a speculators config.json needs a transformer_layer_config object")
    if raw.get("model_type", "llama") != "llama":
        raise ValueError(
            f"{checkpoint.source}: EAGLE-3 layers of model_type {raw['model_type']!r} are not supported (Llama only)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{checkpoint.source}: EAGLE-3 layers with {flag}=true are not supported")
    required = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if not raw.get(k)]
    if required:
        raise ValueError(f"{checkpoint.source}: the layer config lacks {required}")
    from transformers import LlamaConfig

    fields = {k: raw[k] for k in EAGLE3_LAYER_KEYS if raw.get(k) is not None}
    if authors_rope:
        fields = {k: v for k, v in fields.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling")}
        fields["rope_theta"] = POSS_EAGLE3_ROPE_THETA
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = dict(fields["rope_scaling"])
    llama = LlamaConfig(**fields).to_dict()
    return {k: llama[k] for k in EAGLE3_LAYER_KEYS if llama.get(k) is not None}


def _target_depth(target) -> int | None:
    if target is None:
        return None
    if hasattr(target, "config"):
        return target.config.get_text_config().num_hidden_layers
    config = Path(target) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        return data.get("text_config", data).get("num_hidden_layers")
    return None


def eagle3_poss_config(checkpoint: ResearchCheckpoint, num_specialists: int | None = None,
                       positions_per_specialist: int | None = None, target=None,
                       num_target_layers: int | None = None, **overrides) -> PosSEagle3Config:
    """The native `PosSEagle3Config` of an EAGLE-3 checkpoint (see the module docstring)."""
    config = checkpoint.config
    speculators = eagle3_config_layout(config) == "speculators"
    if speculators and config["speculators_model_type"] != "eagle3":
        raise ValueError(
            f"{checkpoint.source} is a speculators {config['speculators_model_type']!r} drafter; only eagle3 ones load"
        )
    authors = not speculators and _layout(checkpoint) == "poss_eagle3"  # trained with the authors' fork
    layer = _layer_fields(checkpoint, speculators, authors_rope=authors)
    hidden = layer["hidden_size"]
    if config.get("target_hidden_size") not in (None, hidden):
        raise ValueError(
            f"{checkpoint.source} fuses target states of size {config['target_hidden_size']} into a drafter of size "
            f"{hidden}: drafters of another width than their target are not supported"
        )
    preset = _preset(checkpoint.source)
    depth = num_target_layers or _target_depth(target) or (preset[1] if preset else None)
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    feature_layers = overrides.pop("feature_layers", None) or config.get("eagle_aux_hidden_state_layer_ids") \
        or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    _, prefixes = layer_prefixes(checkpoint.state_dict)
    found = len(prefixes)
    stacked = stacked_layers(checkpoint.state_dict, prefixes, hidden)
    if stacked:
        raise ValueError(
            f"{checkpoint.source} is a stacked EAGLE-3 drafter: its layers {stacked} read the previous layer's output "
            "(H wide, not 2H), so its layers run in sequence at every position and cannot run as position "
            "specialists. Serve it with vLLM's own EAGLE-3 proposer."
        )
    if num_specialists is not None and num_specialists != found:
        raise ValueError(f"{checkpoint.source} holds {found} EAGLE-3 layer(s), not num_specialists={num_specialists}")
    if positions_per_specialist is None:
        positions_per_specialist = _saved_positions_per_specialist(checkpoint, preset, found)
    target_config = {"hidden_size": hidden, "vocab_size": layer["vocab_size"]}
    if depth is not None:
        target_config["num_hidden_layers"] = depth
    if hasattr(target, "config"):
        target_config["model_type"] = target.config.get_text_config().model_type
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    overrides.setdefault("target_name_or_path", verifier.get("name_or_path") or (preset[0] if preset else None))
    return PosSEagle3Config(
        target_config=target_config, draft_layer_config=layer,
        feature_layers=list(feature_layers) if feature_layers is not None else None,
        num_specialists=found, positions_per_specialist=positions_per_specialist,
        fc_bias="fc.bias" in checkpoint.state_dict,
        norm_before_residual=bool(config.get("norm_before_residual", False)), shared_context_kv=authors,
        draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"], **overrides,
    )


def _saved_positions_per_specialist(checkpoint: ResearchCheckpoint, preset, found: int) -> int:
    """The k of PosS-k a checkpoint implies (module docstring): its config's, the authors' fixed 3 for their
    PosS-on-EAGLE-3 class, a known repo's, else 1 for a single layer; several layers and none of these: ValueError."""
    config = checkpoint.config
    if config.get("positions_per_specialist"):
        return int(config["positions_per_specialist"])
    if is_poss_eagle3_config(config):
        return POSS_EAGLE3_POSITIONS_PER_LAYER
    if preset is not None and preset[2] is not None:
        return preset[2]
    if found > 1:
        raise ValueError(
            f"{checkpoint.source} holds {found} EAGLE-3 layers that each read 2H, but its config.json names neither "
            f"{POSS_EAGLE3_ARCHITECTURE} (the PosS authors' class: 3 positions per layer) nor positions_per_specialist:"
            " if they are PosS specialists pass positions_per_specialist (the k of PosS-k)"
        )
    return 1


# ---- weights ----------------------------------------------------------------------------------------------------
def _source_names(config: PosSConfig, prefixes: list[str]) -> dict[str, str]:
    """Native key -> checkpoint key."""
    with torch.device("meta"):
        names = list(PosSEagle3Drafter(config).state_dict())
    mapping = {}
    for name in names:
        if name.startswith("specialists."):
            index, rest = name[len("specialists."):].split(".", 1)
            mapping[name] = prefixes[int(index)] + rest
        else:
            mapping[name] = {"draft_lm_head.weight": "lm_head.weight", "draft_to_target": "d2t"}.get(name, name)
    return mapping


def check_eagle3_weights(checkpoint: ResearchCheckpoint, config: PosSConfig) -> dict[str, str]:
    """Raise `ValueError` listing every missing, extra or mis-shaped tensor; return native key -> checkpoint key."""
    state = checkpoint.state_dict
    _, prefixes = layer_prefixes(state)
    mapping = _source_names(config, prefixes)
    with torch.device("meta"):
        native = PosSEagle3Drafter(config).state_dict()
    expected = {mapping[k]: tuple(v.shape) for k, v in native.items()}
    expected["t2d"] = (config.vocab_size,)
    optional = {"embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    if config.draft_vocab_size == config.vocab_size:  # a full draft vocabulary needs no map
        optional.update({"d2t": expected.pop("d2t"), "t2d": expected.pop("t2d")})
    problems = tensor_problems(state, expected, optional)
    if problems:
        raise ValueError(f"{checkpoint.source} does not match its config: " + "; ".join(problems) + ".")
    return mapping


def eagle3_native_state_dict(checkpoint: ResearchCheckpoint, config: PosSConfig,
                             mapping: dict[str, str]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under native names; `d2t` offsets become absolute ids, checked against `t2d`."""
    state = checkpoint.state_dict
    native = {name: state[source] for name, source in mapping.items() if name != "draft_to_target"}
    size = config.draft_vocab_size
    offsets = state.get("d2t", torch.zeros(size, dtype=torch.long)).long()
    ids = torch.arange(size) + offsets
    if ids.min() < 0 or ids.max() >= config.vocab_size or ids.unique().numel() != size:
        raise ValueError(f"{checkpoint.source}: d2t does not map the draft vocabulary to distinct target ids")
    if "t2d" in state:
        t2d = state["t2d"].bool()
        if int(t2d.sum()) != size or not bool(t2d[ids].all()):
            raise ValueError(f"{checkpoint.source}: t2d does not mark exactly the target ids that d2t names")
    native["draft_to_target"] = ids
    return native


def eagle3_conversion_record(checkpoint: ResearchCheckpoint, layout: str) -> dict:
    dropped = ["t2d (derived from draft_to_target)"]
    if "embed_tokens.weight" in checkpoint.state_dict:
        dropped.append("embed_tokens.weight (the target's embedding is used)")
    return {
        "converted_from": checkpoint.source, "source_layout": LAYOUT_NAMES[layout],
        "source_weights": checkpoint.weights_file,
        "source_dtype": str(checkpoint.state_dict["fc.weight"].dtype).replace("torch.", "")
        if "fc.weight" in checkpoint.state_dict else None,
        "dropped_keys": dropped,
    }


def _layout(checkpoint: ResearchCheckpoint) -> str:
    if eagle3_config_layout(checkpoint.config) == "speculators":
        return "speculators"
    stem, prefixes = layer_prefixes(checkpoint.state_dict)
    if len(prefixes) > 1 or is_poss_eagle3_config(checkpoint.config):
        return "poss_eagle3"
    architectures = checkpoint.config.get("architectures") or []
    return "specforge" if any("Eagle3" in str(a) for a in architectures) else "safeailab"


def load_eagle3_drafter(cls, path_or_id, num_specialists: int | None = None,
                        positions_per_specialist: int | None = None, target=None,
                        num_target_layers: int | None = None, **kwargs):
    """Build a `cls` (a `PosSDrafter`) from an EAGLE-3 checkpoint (module docstring).

    Args:
        path_or_id: local folder or Hub repo id.
        num_specialists: checked against the layers counted in the weights.
        positions_per_specialist: the k of PosS-k, when the checkpoint does not imply it (module docstring).
        target: optional target model (object or local folder): its depth gives the default fused states, and a
            stored embedding must equal its embedding.
        num_target_layers: the target's depth when no `target` is given and the checkpoint does not say.
        kwargs: hub options, loading options (`dtype`, `device_map`, `attn_implementation`), config overrides
            (`target_name_or_path`, `feature_layers`) and generation settings (`PosSGenerationConfig` fields).
    """
    supported = HUB_KWARGS + _LOAD_KWARGS + _CONFIG_OVERRIDES + _GENERATION_OVERRIDES
    unknown = set(kwargs) - set(supported)
    if unknown:
        raise ValueError(f"Options {sorted(unknown)} are not supported when loading an EAGLE-3 checkpoint; "
                         f"supported: {sorted(supported)}")
    hub_kwargs = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
    overrides = {k: kwargs.pop(k) for k in _CONFIG_OVERRIDES if k in kwargs}
    generation = {k: kwargs.pop(k) for k in _GENERATION_OVERRIDES if k in kwargs}
    checkpoint = read_research_checkpoint(path_or_id, **hub_kwargs)
    config = eagle3_poss_config(checkpoint, num_specialists, positions_per_specialist, target, num_target_layers,
                                **overrides)
    mapping = check_eagle3_weights(checkpoint, config)
    native = eagle3_native_state_dict(checkpoint, config, mapping)
    if target is not None and "embed_tokens.weight" in checkpoint.state_dict:
        check_embedding_matches(checkpoint.state_dict["embed_tokens.weight"], target_input_embedding(target),
                                checkpoint.source)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or "auto"
    if dtype == "auto":
        dtype = checkpoint.state_dict["fc.weight"].dtype
    model, info = cls.from_pretrained(None, config=config, state_dict=native, dtype=dtype,
                                      output_loading_info=True, **kwargs)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:  # checked above; never partial
        raise ValueError(f"Converting {checkpoint.source} left keys unmatched: {info}")
    model.generation_config = PosSGenerationConfig.from_dict(generation)  # the drafter's budget
    model.training_record = eagle3_conversion_record(checkpoint, _layout(checkpoint))
    return model


def read_if_eagle3_checkpoint(cls, path_or_id, *model_args, num_specialists=None, positions_per_specialist=None,
                              **kwargs):
    """The `checkpoints.loading.CHECKPOINT_READERS` entry: a converted drafter when `path_or_id` holds an EAGLE-3 layout,
    else `None`."""
    if not is_eagle3_checkpoint(path_or_id, **{k: v for k, v in kwargs.items() if k in HUB_KWARGS}):
        return None
    if model_args:
        raise ValueError("positional model arguments are not supported for EAGLE-3 checkpoints")
    return load_eagle3_drafter(cls, path_or_id, num_specialists=num_specialists,
                               positions_per_specialist=positions_per_specialist, **kwargs)


def convert_eagle3_checkpoint(source, destination, overwrite: bool = False, **kwargs) -> PosSDrafter:
    """Write a native drafter folder from an EAGLE-3 checkpoint (`load_eagle3_drafter`'s options); returns it."""
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())) and not overwrite:
        raise ValueError(f"{destination} exists and is not empty; choose another folder or pass overwrite=True")
    drafter = load_eagle3_drafter(PosSDrafter, source, **kwargs)
    drafter.save_pretrained(destination)
    return drafter


__all__ = [
    "EAGLE3_PRESETS", "POSS_EAGLE3_ARCHITECTURE", "convert_eagle3_checkpoint", "eagle3_config_layout",
    "is_eagle3_checkpoint", "is_poss_eagle3_config", "load_eagle3_drafter", "read_if_eagle3_checkpoint",
]
