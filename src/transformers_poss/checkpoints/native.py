"""The native drafter folder: what `PosSDrafter.from_pretrained` reads beside `config.json` and the weights."""

from __future__ import annotations

import json
from pathlib import Path

from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from ..configuration_poss import LEGACY_RECORD_KEYS, PosSGenerationConfig

HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "subfolder")


def read_drafter_files(name_or_path, **hub_kwargs) -> tuple[PosSGenerationConfig, dict[str, dict]]:
    """A native drafter folder's (or Hub repo's) generation config and records: `(generation_config,
    {"training_record": {...}, "tuning_record": {...}})`, from `generation_config.json`, `training_record.json` and
    `tuning_record.json`, or, for folders saved before those files existed, from `config.json`."""
    def read_json(name: str) -> dict | None:
        path = cached_file(str(name_or_path), name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        return json.loads(Path(path).read_text(encoding="utf-8")) if path else None

    legacy = read_json("config.json") or {}
    generation = read_json(GENERATION_CONFIG_NAME)
    generation_config = (PosSGenerationConfig.from_dict(generation) if generation is not None
                         else PosSGenerationConfig.from_legacy_config(legacy))
    records = {}
    for key in LEGACY_RECORD_KEYS:
        record = read_json(f"{key}.json")
        records[key] = record if record is not None else dict(legacy.get(key) or {})
    return generation_config, records
