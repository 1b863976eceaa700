"""`poss export`: write a drafter in a format an inference engine serves.

**`--format speculators`** (what vLLM loads with `--speculative-config '{"model": DST, ...}'`; the layout is read
back by `PosSDrafter.from_pretrained`, see `checkpoints.eagle3`): `config.json` with `speculators_model_type: "eagle3"`,
`architectures: ["Eagle3Speculator"]`, `transformer_layer_config` (the specialist's Llama config, one layer, the
target vocabulary), `draft_vocab_size`, `norm_before_residual` (always written: vLLM assumes `true` when it is absent,
speculators `false`), `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (the fused target states) and
`speculators_config` (`algorithm`, one greedy proposal method whose `speculative_tokens` is the drafter's
`tree_depth`, the `verifier`); `model.safetensors` with `layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`,
`d2t` (int64 offsets, `target id = draft id + d2t`) and `t2d` (bool over the target vocabulary); no embedding (vLLM
shares the target's).

**Position specialists.** The speculators format has no place for one layer per group of positions: vLLM's own
EAGLE-3 proposer runs one layer for every draft position (`--format vllm` with the `poss_vllm` plugin serves every
specialist). A drafter with several specialists is therefore **refused** in this format, unless
`first_specialist=True` (`--first-specialist`) exports specialist 0 alone with a warning: it is the specialist trained
for positions `1 .. k` and is run at every position, so acceptance at later positions is what a single-layer
EAGLE-3 drafter gets, not what PosS gets. Only EAGLE-3 drafters (`drafter_type="eagle3"`) without an `fc` bias
(vLLM builds `fc` without one) can be exported. `verifier.architectures` is the target's: the bound target's config,
else the `target` folder's `config.json`, else the family's causal-LM class named by the drafter's `target_config`.

**`--format vllm`** (what the `poss_vllm` plugin in `integrations/vllm` serves, every position specialist included):
the same speculators layout, `speculators_model_type` `"eagle"` (EAGLE-1/2-style drafters: `fc` with its bias, the
target family's layers without the input norm, the draft head with its mapped rows) or `"eagle3"`, with
`transformer_layer_config` holding one layer per specialist (`num_hidden_layers = num_specialists`) and a `poss` block
(`VLLM_FORMAT`, version `VLLM_FORMAT_VERSION`): drafter type, `num_specialists`, `positions_per_specialist`,
`position_groups` (positions each specialist serves, `PosSConfig.group_sizes`; the plugin maps positions with it), `fc_bias`,
`shared_context_kv` (recorded; the plugin serves per-specialist KV caches and warns), `draft_vocab_size`,
`draft_head_rows`, the target's family / hidden size / vocabulary / depth / name / architectures, and the weights
file's name, size and SHA-256 (checked by the plugin before serving). `model.safetensors` keeps the drafter's own
tensor names (`fc.*`, `specialists.{i}.*`, `draft_lm_head.weight`, `draft_head_map.weight`, `draft_to_target`,
`norm.weight`); the embedding and the target's `lm_head` are not written (vLLM shares the
target's). `first_specialist=True` writes specialist 0 alone as a one-specialist drafter (to compare against PosS).
The `poss` block's `speculative_config` (`vllm_speculative_config`) suggests K and, from the drafter's tuned
`max_batch_size`, vLLM's `num_speculative_tokens_per_batch_size` schedule (no drafting above that batch size).
EAGLE-1/2-style drafters need a Llama or Mistral target (vLLM's Llama decoder layer) and the final target state only
(`feature_layers` unset or `[-1]`).

Both formats: an EAGLE-3 drafter whose checkpoint names no fused target layers (SafeAILab, SpecForge, the PosS
authors' PosS on EAGLE-3, read as they are by `PosSDrafter.from_pretrained`) takes EAGLE-3's default for the depth of
the `target` folder (`--target`), which it then needs. A PosS-on-EAGLE-3 checkpoint exports with its layers as
specialists and its positions per specialist (3), so the plugin drafts position `p` with layer `min((p - 1) // 3,
n - 1)`, the layer the authors' training used for every trained position (`checkpoints.eagle3`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

from ..generation_config import resolve_budget
from ..modeling_poss import PosSDrafter
from ..modeling_poss_eagle3 import PosSEagle3Drafter

EXPORT_FORMATS = ("speculators", "vllm")
SPECULATORS_VERSION = "0.3.0"
VLLM_FORMAT = "poss-vllm"
VLLM_FORMAT_VERSION = 1
# A target family's causal-LM class, for `verifier.architectures` when neither a target nor its folder is at hand.
FAMILY_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
}
# The poss_vllm plugin's model class of each drafter kind (`drafter_type`).
VLLM_ARCHITECTURES = {"eagle": "PosSEagleForCausalLM", "eagle3": "PosSEagle3LlamaForCausalLM"}
VLLM_EAGLE_FAMILIES = ("llama", "mistral")  # families whose decoder layer vLLM's LlamaDecoderLayer computes


def target_folder_config(target) -> dict | None:
    """The `config.json` of a local target folder (its text config for multimodal ones), or None without a folder."""
    if target is None:
        return None
    path = Path(target) / "config.json"
    if not path.is_file():
        raise ValueError(f"--target {target} is not a model folder with a config.json")
    config = json.loads(path.read_text(encoding="utf-8"))
    text = config.get("text_config") or {}
    return {**config, **{k: v for k, v in text.items() if k not in ("architectures",)}}


def check_target_folder(drafter: PosSDrafter, target_config: dict | None) -> None:
    """Raise `ValueError` when the `--target` folder's model is not shaped like the drafter's target."""
    if target_config is None:
        return
    expected = drafter.config.target_config
    for key in ("model_type", "hidden_size", "vocab_size"):
        if expected.get(key) is not None and target_config.get(key) is not None and expected[key] != target_config[key]:
            raise ValueError(
                f"This drafter was built for a target with {key}={expected[key]!r}; the --target folder's model has "
                f"{key}={target_config[key]!r}: export it with the target it was trained for"
            )


def resolve_fused_layers(drafter: PosSDrafter, target_config: dict | None) -> None:
    """Give an EAGLE-3 drafter whose checkpoint names no fused target layers (SafeAILab, SpecForge, PosS on EAGLE-3)
    EAGLE-3's default for the `--target` folder's depth (what binding to that target does); ValueError without one."""
    config = drafter.config
    if config.feature_layers_resolved:
        return
    depth = (target_config or {}).get("num_hidden_layers")
    if depth is None:
        raise ValueError(
            "This EAGLE-3 drafter does not name the target layers it fuses (EAGLE-3's default [2, L // 2, L - 3] "
            "depends on the target's depth L): pass the target's folder, target= (--target)"
        )
    config.resolve_feature_layers(depth)


def verifier_architectures(drafter: PosSDrafter, target_config: dict | None = None) -> list[str]:
    """The target's architectures: the target folder's, else the family's causal-LM class."""
    if target_config and target_config.get("architectures"):
        return list(target_config["architectures"])
    family = drafter.config.target_model_type
    return [FAMILY_ARCHITECTURES[family]] if family in FAMILY_ARCHITECTURES else []


def _prepare_destination(destination, overwrite: bool) -> Path:
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())) and not overwrite:
        raise ValueError(f"{destination} exists and is not empty; choose another folder or pass overwrite=True")
    destination.mkdir(parents=True, exist_ok=True)
    return destination


def speculators_config(drafter: PosSDrafter, verifier: str, verifier_architectures: list[str]) -> dict:
    """The speculators `config.json` of a one-specialist EAGLE-3 `drafter`."""
    config = drafter.config
    layer = config.layer_config()
    layer.num_hidden_layers = 1
    layer.vocab_size = config.vocab_size
    layer_dict = {k: v for k, v in layer.to_dict().items()
                  if k not in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype")}
    depth = resolve_budget(drafter.generation_config, None)[0]["tree_depth"]  # of kinds without a tuned entry
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": depth}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer_dict,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "torch_dtype": str(drafter.dtype).replace("torch.", ""),
    }


def speculators_tensors(drafter: PosSDrafter) -> dict[str, torch.Tensor]:
    """Specialist 0 and the shared weights under speculators' names (contiguous CPU tensors)."""
    state = drafter.state_dict()
    tensors = {}
    for name, value in state.items():
        if name.startswith("specialists.0."):
            tensors["layers.0." + name[len("specialists.0."):]] = value
        elif name in ("fc.weight", "norm.weight"):
            tensors[name] = value
        elif name == "draft_lm_head.weight":
            tensors["lm_head.weight"] = value
    ids = drafter.draft_to_target.detach().cpu().long()
    tensors["d2t"] = ids - torch.arange(ids.shape[0])
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def export_speculators(drafter: PosSDrafter, destination, first_specialist: bool = False, verifier: str | None = None,
                       overwrite: bool = False, target=None) -> Path:
    """Write `drafter` to `destination` in the speculators EAGLE-3 format (module docstring); returns the folder."""
    drafter = drafter.merged()  # LoRA specialists leave as full layers
    config = drafter.config
    if not isinstance(drafter, PosSEagle3Drafter):
        raise ValueError(
            "Only EAGLE-3 drafters (drafter_type='eagle3') export to the speculators eagle3 format: this drafter is "
            "an EAGLE-1/2-style one (fc over [embedding, feature], the target's lm_head), which vLLM's EAGLE-3 "
            "proposer cannot run"
        )
    if config.fc_bias:
        raise ValueError("This drafter's fc has a bias; vLLM builds the EAGLE-3 fc without one, so it cannot load it")
    if config.num_specialists > 1:
        if not first_specialist:
            raise ValueError(
                f"This drafter has {config.num_specialists} position specialists, and the speculators format has no "
                "place for one layer per group of positions (vLLM's EAGLE-3 proposer runs one layer at every "
                "position). Export it with --format vllm (the poss_vllm plugin drafts each position with its own "
                "specialist), or pass first_specialist=True (--first-specialist) to export specialist 0 alone, "
                "knowing that later positions then lose what their specialists learned."
            )
        warnings.warn(
            f"Exporting specialist 0 of {config.num_specialists} (trained for draft positions 1 .. "
            f"{config.group_sizes[0]}); the engine will run it at every draft position", stacklevel=2,
        )
    target_config = target_folder_config(target)
    check_target_folder(drafter, target_config)
    resolve_fused_layers(drafter, target_config)
    verifier = verifier or (str(Path(target).resolve()) if target is not None else None) or config.target_name_or_path
    if not verifier:
        raise ValueError("The speculators format names its verifier (target): pass verifier= (--verifier)")
    architectures = verifier_architectures(drafter, target_config)
    destination = _prepare_destination(destination, overwrite)
    from safetensors.torch import save_file

    save_file(speculators_tensors(drafter), str(destination / "model.safetensors"), metadata={"format": "pt"})
    text = json.dumps(speculators_config(drafter, verifier, architectures), indent=2, sort_keys=True) + "\n"
    (destination / "config.json").write_text(text, encoding="utf-8")
    return destination


# ---- --format vllm (the poss_vllm plugin) -------------------------------------------------------------------------
def vllm_layer_config(drafter: PosSDrafter, num_specialists: int) -> dict:
    """The specialists' layer config (the target family's, or EAGLE-3's Llama one), one layer per specialist."""
    config = drafter.config
    layer = config.layer_config()
    layer.num_hidden_layers = num_specialists
    layer.vocab_size = config.vocab_size
    skip = ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "layer_types",
            "_attn_implementation_autoset", "id2label", "label2id")
    return {k: v for k, v in layer.to_dict().items() if k not in skip}


def vllm_tensors(drafter: PosSDrafter, first_specialist: bool = False) -> dict[str, torch.Tensor]:
    """The drafter's tensors under their own names (specialist 0's only with `first_specialist`), contiguous on the
    CPU; `draft_to_target` as int64 target ids."""
    tensors = {}
    for name, value in drafter.state_dict().items():
        if name.startswith("specialists."):
            if first_specialist and not name.startswith("specialists.0."):
                continue
        elif name not in ("fc.weight", "fc.bias", "norm.weight", "draft_lm_head.weight", "draft_head_map.weight",
                          "draft_to_target"):
            continue
        tensors[name] = value
    if "draft_to_target" in tensors:
        tensors["draft_to_target"] = tensors["draft_to_target"].long()
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def vllm_speculative_config(drafter: PosSDrafter) -> dict:
    """The speculative config an export suggests to vLLM (the `poss` block's `speculative_config`): K
    (`num_speculative_tokens`, the drafter's `tree_depth`) and, where the drafter has a tuned `max_batch_size`, the
    smallest of those of the 16-bit device kinds in `device_budgets` (what engines serve in; every kind's when none is
    16-bit; the top-level one otherwise) as `max_batch_size` and vLLM's `num_speculative_tokens_per_batch_size`
    schedule: K draft tokens up to that many scheduled requests, none above (inclusive `[start, end, K]` ranges, the
    last K carried to larger batches). The poss_vllm plugin applies it."""
    settings = drafter.generation_config
    default, _ = resolve_budget(settings, None)  # the budget of kinds without an entry
    k = default["tree_depth"]
    by_kind = {kind: entry["max_batch_size"] for kind, entry in sorted(settings.device_budgets.items())
               if entry.get("max_batch_size") is not None}
    served = {kind: limit for kind, limit in by_kind.items() if kind.endswith(("/bfloat16", "/float16"))}
    limits = list((served or by_kind).values())
    if not limits and default["max_batch_size"] is not None:
        limits.append(default["max_batch_size"])
    suggestion = {"num_speculative_tokens": k, "max_batch_size_by_device_kind": by_kind}
    if limits:
        limit = min(limits)
        suggestion["max_batch_size"] = limit
        suggestion["num_speculative_tokens_per_batch_size"] = (
            [[1, limit, k], [limit + 1, limit + 1, 0]] if limit > 0 else [[1, 1, 0]])
    return suggestion


def check_vllm_exportable(drafter: PosSDrafter) -> None:
    """Raise `ValueError` on drafters the poss_vllm plugin cannot serve."""
    config = drafter.config
    if isinstance(drafter, PosSEagle3Drafter):
        if config.fc_bias:
            raise ValueError("This EAGLE-3 drafter's fc has a bias, which vLLM's EAGLE-3 fusion has no place for")
        return
    if config.target_model_type not in VLLM_EAGLE_FAMILIES:
        raise ValueError(
            f"--format vllm serves EAGLE-1/2-style drafters of {VLLM_EAGLE_FAMILIES} targets (vLLM's Llama decoder "
            f"layer); this drafter's target is a {config.target_model_type!r} model"
        )
    if config.input_feature_layers != [-1]:
        raise ValueError(
            f"This drafter fuses target states {config.feature_layers}; vLLM's EAGLE proposer hands the drafter the "
            "final target state only, so --format vllm needs feature_layers unset or [-1]"
        )


def export_vllm(drafter: PosSDrafter, destination, first_specialist: bool = False, verifier: str | None = None,
                target=None, overwrite: bool = False) -> Path:
    """Write `drafter` for the poss_vllm plugin (module docstring, `--format vllm`); returns the folder.

    `target`: a local target folder: checked against the drafter's target, its `config.json` gives the verifier's
    architectures, and it is the verifier named in the folder (what `vllm serve FOLDER` loads) unless `verifier` is
    given; without either, the drafter's `target_name_or_path`.
    """
    drafter = drafter.merged()  # LoRA specialists leave as full layers
    config = drafter.config
    check_vllm_exportable(drafter)
    target_config = target_folder_config(target)
    check_target_folder(drafter, target_config)
    resolve_fused_layers(drafter, target_config)
    verifier = verifier or (str(Path(target).resolve()) if target is not None else None) or config.target_name_or_path
    if not verifier:
        raise ValueError("The export names its verifier (the target vLLM serves): pass target= (--target) or "
                         "verifier= (--verifier)")
    num_specialists = 1 if first_specialist else config.num_specialists
    if first_specialist and config.num_specialists > 1:
        warnings.warn(
            f"Exporting specialist 0 of {config.num_specialists} (trained for draft positions 1 .. "
            f"{config.group_sizes[0]}); vLLM will run it at every draft position", stacklevel=2,
        )
    destination = _prepare_destination(destination, overwrite)
    from safetensors.torch import save_file

    weights_path = destination / "model.safetensors"
    save_file(vllm_tensors(drafter, first_specialist), str(weights_path), metadata={"format": "pt"})
    digest = hashlib.sha256(weights_path.read_bytes()).hexdigest()
    target_facts = config.target_config
    if target_config:
        target_facts = {**target_facts, **{k: target_config[k] for k in ("num_hidden_layers",) if k in target_config}}
    drafter_type = config.drafter_type
    poss = {
        "format": VLLM_FORMAT,
        "format_version": VLLM_FORMAT_VERSION,
        "drafter_type": drafter_type,
        "num_specialists": num_specialists,
        "positions_per_specialist": config.positions_per_specialist,
        "position_groups": config.group_sizes[:num_specialists],
        "first_specialist_only": bool(first_specialist and config.num_specialists > 1),
        "fc_bias": bool(config.fc_bias),
        "shared_context_kv": bool(config.shared_context_kv),
        "draft_vocab_size": config.draft_vocab_size,
        "draft_head_rows": config.draft_head_rows,
        "target": {
            "model_type": target_facts.get("model_type"),
            "hidden_size": target_facts.get("hidden_size"),
            "vocab_size": target_facts.get("vocab_size"),
            "num_hidden_layers": target_facts.get("num_hidden_layers"),
            "name_or_path": config.target_name_or_path,
            "architectures": verifier_architectures(drafter, target_config),
        },
        "weights": {"file": weights_path.name, "bytes": weights_path.stat().st_size, "sha256": digest},
        "speculative_config": vllm_speculative_config(drafter),
    }
    folder_config = {
        "architectures": [VLLM_ARCHITECTURES[drafter_type]],
        "speculators_model_type": drafter_type,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": drafter_type,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": poss["speculative_config"]["num_speculative_tokens"]}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": poss["target"]["architectures"]},
        },
        "transformer_layer_config": vllm_layer_config(drafter, num_specialists),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "poss": poss,
        "torch_dtype": str(drafter.dtype).replace("torch.", ""),
    }
    if isinstance(drafter, PosSEagle3Drafter):
        folder_config["norm_before_residual"] = config.norm_before_residual
        folder_config["eagle_aux_hidden_state_layer_ids"] = list(config.feature_layers)
    text = json.dumps(folder_config, indent=2, sort_keys=True) + "\n"
    (destination / "config.json").write_text(text, encoding="utf-8")
    return destination
