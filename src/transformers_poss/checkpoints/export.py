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

**Position specialists.** No engine drafts with one layer per group of positions: vLLM's EAGLE-3 proposer runs one
layer for every draft position. A drafter with several specialists is therefore **refused**, unless
`first_specialist=True` (`--first-specialist`) exports specialist 0 alone with a warning: it is the specialist trained
for positions `1 .. k` and is run at every position, so acceptance at later positions is what a single-layer
EAGLE-3 drafter gets, not what PosS gets. Only EAGLE-3 drafters (`drafter_type="eagle3"`) without an `fc` bias
(vLLM builds `fc` without one) can be exported.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..modeling_poss import PosSDrafter

EXPORT_FORMATS = ("speculators",)
SPECULATORS_VERSION = "0.3.0"


def speculators_config(drafter: PosSDrafter, verifier: str, verifier_architectures: list[str]) -> dict:
    """The speculators `config.json` of a one-specialist EAGLE-3 `drafter`."""
    config = drafter.config
    layer = config.layer_config()
    layer.num_hidden_layers = 1
    layer.vocab_size = config.vocab_size
    layer_dict = {k: v for k, v in layer.to_dict().items()
                  if k not in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": drafter.generation_config.tree_depth}],
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
                       overwrite: bool = False) -> Path:
    """Write `drafter` to `destination` in the speculators EAGLE-3 format (module docstring); returns the folder."""
    config = drafter.config
    if not config.is_eagle3:
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
                f"This drafter has {config.num_specialists} position specialists, and no inference engine drafts with "
                "one layer per group of positions (vLLM's EAGLE-3 proposer runs one layer at every position). Pass "
                "first_specialist=True (--first-specialist) to export specialist 0 alone, knowing that later "
                "positions then lose what their specialists learned."
            )
        warnings.warn(
            f"Exporting specialist 0 of {config.num_specialists} (trained for draft positions 1 .. "
            f"{config.positions_per_specialist}); the engine will run it at every draft position", stacklevel=2,
        )
    verifier = verifier or config.target_name_or_path
    if not verifier:
        raise ValueError("The speculators format names its verifier (target): pass verifier= (--verifier)")
    target = drafter.bound_target
    architectures = list(getattr(target.config, "architectures", None) or []) if target is not None else []
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())) and not overwrite:
        raise ValueError(f"{destination} exists and is not empty; choose another folder or pass overwrite=True")
    destination.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(speculators_tensors(drafter), str(destination / "model.safetensors"), metadata={"format": "pt"})
    text = json.dumps(speculators_config(drafter, verifier, architectures), indent=2, sort_keys=True) + "\n"
    (destination / "config.json").write_text(text, encoding="utf-8")
    return destination
