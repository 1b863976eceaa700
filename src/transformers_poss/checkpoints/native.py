"""The native drafter folder: what `PosSDrafter.from_pretrained` reads beside `config.json` and the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from ..configuration_poss import RECORD_NAMES
from ..generation_config import PosSGenerationConfig

HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "subfolder")


@dataclass
class DrafterFiles:
    """What a native folder holds besides `config.json` and the weights.

    Attributes:
        generation_config: the drafting budget (`generation_config.json`; the defaults when absent).
        records: `{"training_record": {...}, "tuning_record": {...}}` (empty where a file is absent).
    """

    generation_config: PosSGenerationConfig
    records: dict[str, dict] = field(default_factory=dict)


def read_drafter_files(name_or_path, **hub_kwargs) -> DrafterFiles:
    """A native drafter folder's (or Hub repo's) generation config and records, from `generation_config.json`,
    `training_record.json` and `tuning_record.json`."""
    def read_json(name: str) -> dict | None:
        path = cached_file(str(name_or_path), name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        return json.loads(Path(path).read_text(encoding="utf-8")) if path else None

    generation = read_json(GENERATION_CONFIG_NAME)
    generation_config = PosSGenerationConfig() if generation is None else PosSGenerationConfig.from_dict(generation)
    records = {name: read_json(f"{name}.json") or {} for name in RECORD_NAMES}
    return DrafterFiles(generation_config, records)
