"""The native drafter folder: what `PosSDrafter.from_pretrained` reads beside `config.json` and the weights."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from ..configuration_poss import LEGACY_RECORD_KEYS, REMOVED_GENERATION_SETTINGS, PosSGenerationConfig

HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "subfolder")


@dataclass
class DrafterFiles:
    """What a native folder holds besides `config.json` and the weights.

    Attributes:
        generation_config: the drafting budget (`generation_config.json`).
        records: `{"training_record": {...}, "tuning_record": {...}}`.
        int8_draft_weights: the 8-bit drafting kernel setting of folders saved when it was a generation setting
            (None when the folder does not say).
    """

    generation_config: PosSGenerationConfig
    records: dict[str, dict] = field(default_factory=dict)
    int8_draft_weights: bool | None = None


def read_drafter_files(name_or_path, **hub_kwargs) -> DrafterFiles:
    """A native drafter folder's (or Hub repo's) generation config and records, from `generation_config.json`,
    `training_record.json` and `tuning_record.json`, or, for folders saved before those files existed, from
    `config.json`. Settings that left the generation config (`REMOVED_GENERATION_SETTINGS`) are read where they went:
    `int8_draft_weights` as the kernel setting; a `deep_draft_vocab` that was set is dropped with a warning."""
    def read_json(name: str) -> dict | None:
        path = cached_file(str(name_or_path), name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        return json.loads(Path(path).read_text(encoding="utf-8")) if path else None

    legacy = read_json("config.json") or {}
    generation = read_json(GENERATION_CONFIG_NAME)
    removed = {name: generation.pop(name) for name in REMOVED_GENERATION_SETTINGS if name in (generation or {})}
    if removed.get("deep_draft_vocab") is not None:
        warnings.warn(f"{name_or_path}: deep_draft_vocab={removed['deep_draft_vocab']} is ignored (the option was "
                      "removed; drafting scores the whole draft vocabulary at every position)", stacklevel=3)
    generation_config = (PosSGenerationConfig.from_dict(generation) if generation is not None
                         else PosSGenerationConfig.from_legacy_config(legacy))
    records = {}
    for key in LEGACY_RECORD_KEYS:
        record = read_json(f"{key}.json")
        records[key] = record if record is not None else dict(legacy.get(key) or {})
    return DrafterFiles(generation_config, records, removed.get("int8_draft_weights"))
