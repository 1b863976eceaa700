"""Loading and saving drafters: what `PosSDrafter.from_pretrained` / `save_pretrained` do besides transformers' own.

A folder or Hub id is read by the first of `CHECKPOINT_READERS` that knows its layout (research and EAGLE-3
checkpoints, converted on load; `transformers_poss` registers them on import), else as a native drafter folder:
`config.json` and the weights (transformers' loader; LoRA specialists by `load_state_dict`), then
`generation_config.json` and the records.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..configuration_poss import RECORD_NAMES, PosSConfig
from .custom_generate import write_custom_generate
from .native import HUB_KWARGS, read_drafter_files

# Readers of other checkpoint layouts, tried in order: `reader(cls, path_or_id, **kwargs)` returns a drafter, or None
# when the folder is not of its layout.
CHECKPOINT_READERS: list = []


def load_drafter(cls, name_or_path, *model_args, load_native, num_specialists=None, positions_per_specialist=None,
                 **kwargs):
    """A drafter of class `cls` (or its config's kind) from `name_or_path`: a checkpoint reader's conversion, else a
    native folder loaded by `load_native` (transformers' `from_pretrained`) with its generation config and records.
    `num_specialists` / `positions_per_specialist` are for research checkpoints only."""
    if name_or_path is not None:
        for reader in CHECKPOINT_READERS:
            drafter = reader(cls, name_or_path, *model_args, num_specialists=num_specialists,
                             positions_per_specialist=positions_per_specialist, **kwargs)
            if drafter is not None:
                return drafter
    if num_specialists is not None or positions_per_specialist is not None:
        raise ValueError(
            "num_specialists / positions_per_specialist are read from a native drafter's config.json; they are "
            "only accepted for research-format (EAGLE/HASS/PosS) checkpoints"
        )
    drafter = _load_lora(cls, name_or_path, **kwargs)
    if drafter is None:
        drafter = load_native(name_or_path, *model_args, **kwargs)
    if name_or_path is not None:
        files = read_drafter_files(name_or_path, **{k: kwargs[k] for k in HUB_KWARGS if k in kwargs})
        drafter.generation_config = files.generation_config
        for key, record in files.records.items():
            setattr(drafter, key, record)
    return drafter


def _load_lora(cls, name_or_path, **kwargs):
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


def save_drafter_files(drafter, save_directory) -> None:
    """Write what a native folder holds besides `config.json` and the weights: `generation_config.json`, the records
    (`training_record.json`, `tuning_record.json`, when not empty; a stale one is removed) and `custom_generate/`
    (`generate(custom_generate=FOLDER_OR_REPO, trust_remote_code=True)` drafts with the drafter)."""
    folder = Path(save_directory)
    drafter.generation_config.save_pretrained(folder)
    write_custom_generate(folder)
    for key in RECORD_NAMES:
        path = folder / f"{key}.json"
        if getattr(drafter, key):
            path.write_text(json.dumps(getattr(drafter, key), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        elif path.exists():  # a record of earlier weights does not describe these
            path.unlink()
