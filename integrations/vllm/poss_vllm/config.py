"""The exported folder's config: speculators types "eagle" (PosS EAGLE-1/2-style) and "eagle3" with a `poss` block,
and the checks made before a PosS drafter is served."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from . import FORMAT_NAME, FORMAT_VERSION, PosSServingError, check_vllm_version

EAGLE_ARCH = "PosSEagleForCausalLM"
EAGLE3_ARCH = "PosSEagle3LlamaForCausalLM"
EAGLE_FAMILIES = ("llama", "mistral")  # target families whose decoder layer vLLM's LlamaDecoderLayer computes


def check_poss_block(poss: dict, drafter_type: str) -> None:
    """Raise `PosSServingError` on a `poss` block this plugin cannot serve."""
    if not isinstance(poss, dict) or poss.get("format") != FORMAT_NAME:
        raise PosSServingError("This folder's config.json has no valid `poss` block: write it with "
                               "`poss export --format vllm`")
    if poss.get("format_version") != FORMAT_VERSION:
        raise PosSServingError(
            f"This export is format version {poss.get('format_version')!r}; poss_vllm reads version {FORMAT_VERSION}. "
            "Export the drafter again with the matching transformers_poss, or update the plugin."
        )
    if poss.get("drafter_type") != drafter_type:
        raise PosSServingError(f"The poss block says drafter_type={poss.get('drafter_type')!r} but the folder is a "
                               f"speculators {drafter_type!r} config")
    for key in ("num_specialists", "positions_per_specialist"):
        if not isinstance(poss.get(key), int) or poss[key] < 1:
            raise PosSServingError(f"poss.{key} must be a positive integer, got {poss.get(key)!r}")
    target = poss.get("target") or {}
    if drafter_type == "eagle" and target.get("model_type") not in EAGLE_FAMILIES:
        raise PosSServingError(
            f"poss_vllm serves EAGLE-1/2-style PosS drafters of {EAGLE_FAMILIES} targets; this one was built for a "
            f"{target.get('model_type')!r} target"
        )


def _eagle_updater(config_dict: dict, pre_trained_config: dict) -> None:
    """speculators type "eagle": a PosS EAGLE-1/2-style drafter (vLLM 0.32 has no speculators "eagle" type)."""
    check_vllm_version()
    poss = config_dict.get("poss")
    if poss is None:
        raise PosSServingError(
            "speculators_model_type 'eagle' is read by the poss_vllm plugin for PosS drafters only (a `poss` block "
            "written by `poss export --format vllm`); this config has none"
        )
    check_poss_block(poss, "eagle")
    pre_trained_config["architectures"] = [EAGLE_ARCH]
    pre_trained_config["draft_vocab_size"] = poss.get("draft_vocab_size") or pre_trained_config.get("vocab_size")
    pre_trained_config["target_hidden_size"] = config_dict.get("target_hidden_size")
    pre_trained_config["poss"] = poss


def _wrap_eagle3(original):
    def update_eagle3(config_dict: dict, pre_trained_config: dict) -> None:
        """speculators "eagle3": vLLM's own updater; with a `poss` block, the PosS EAGLE-3 model instead."""
        original(config_dict=config_dict, pre_trained_config=pre_trained_config)
        poss = config_dict.get("poss")
        if poss is None:
            return
        check_vllm_version()
        check_poss_block(poss, "eagle3")
        pre_trained_config["architectures"] = [EAGLE3_ARCH]
        pre_trained_config["poss"] = poss

    update_eagle3.poss_wrapped = True
    return update_eagle3


def register_speculator_types() -> None:
    from vllm.transformers_utils.configs.speculators import algos
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    types = algos.SUPPORTED_SPECULATORS_TYPES
    types["eagle"] = _eagle_updater
    if "eagle3" in types and not getattr(types["eagle3"], "poss_wrapped", False):
        types["eagle3"] = _wrap_eagle3(types["eagle3"])
    original = SpeculatorsConfig.__dict__["from_pretrained"].__func__
    if getattr(original, "poss_wrapped", False):
        return

    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """vLLM's, then (a local PosS export) its weights file checked in the process that reads the config, before
        any engine starts (the engine checks it again before loading)."""
        config = original(cls, pretrained_model_name_or_path, **kwargs)
        poss = getattr(config, "poss", None)
        if isinstance(poss, dict) and Path(str(pretrained_model_name_or_path)).is_dir():
            check_weights(pretrained_model_name_or_path, poss)
        return config

    from_pretrained.poss_wrapped = True
    SpeculatorsConfig.from_pretrained = classmethod(from_pretrained)


# ---- checks in the engine process, before weights load ----------------------------------------------------------
def check_target(poss: dict, target_config) -> None:
    """Raise `PosSServingError` if the served target is not the kind the drafter was built for."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    expected = poss.get("target") or {}
    facts = {
        "model_type": (expected.get("model_type"), getattr(text, "model_type", None)),
        "hidden_size": (expected.get("hidden_size"), getattr(text, "hidden_size", None)),
        "vocab_size": (expected.get("vocab_size"), getattr(text, "vocab_size", None)),
    }
    if poss.get("drafter_type") == "eagle3":
        facts["num_hidden_layers"] = (expected.get("num_hidden_layers"), getattr(text, "num_hidden_layers", None))
    wrong = {name: pair for name, pair in facts.items() if pair[0] is not None and pair[0] != pair[1]}
    if wrong:
        detail = ", ".join(f"{name}={drafter!r} (the served target has {served!r})"
                           for name, (drafter, served) in wrong.items())
        raise PosSServingError(
            f"This PosS drafter was built for another target ({expected.get('name_or_path') or 'unnamed'}): {detail}. "
            "Serve it with the target it was trained for, or export a drafter trained for this one."
        )


def safetensors_names(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header (raises on a file too short for its header)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise PosSServingError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise PosSServingError(f"{path} is truncated: its header needs {length} bytes, the file has {size}")
        header = json.loads(handle.read(length))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise PosSServingError(f"{path} is truncated: its tensors need {8 + length + end} bytes, the file has {size}")
    return {key: entry for key, entry in header.items() if key != "__metadata__"}


def check_weights(folder: str | os.PathLike, poss: dict) -> Path:
    """Raise `PosSServingError` unless the export's weights file is there, whole and the one the config names."""
    weights = poss.get("weights") or {}
    path = Path(folder) / weights.get("file", "model.safetensors")
    if not path.is_file():
        raise PosSServingError(f"The PosS drafter's weights file {path} is missing: export the drafter again "
                               "(`poss export --format vllm`)")
    size = path.stat().st_size
    if weights.get("bytes") is not None and size != weights["bytes"]:
        raise PosSServingError(
            f"The PosS drafter's weights file {path} has {size} bytes, the export wrote {weights['bytes']}: it is "
            "truncated or another file; copy or export it again"
        )
    safetensors_names(path)
    if weights.get("sha256"):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != weights["sha256"]:
            raise PosSServingError(f"The PosS drafter's weights file {path} does not match the SHA-256 its "
                                   "config.json records: copy or export it again")
    return path
