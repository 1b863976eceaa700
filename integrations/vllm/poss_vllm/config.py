"""The exported folder's config: speculators types "eagle" (PosS EAGLE-1/2-style) and "eagle3" with a `poss` block,
and the checks made before a PosS drafter is served."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from . import FORMAT_NAME, FORMAT_VERSION, PosSServingError, check_vllm_version

logger = logging.getLogger("vllm.poss_vllm")  # under vLLM's logger: its handlers and level

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
    keys = ("num_specialists",) if poss.get("position_groups") is not None else ("num_specialists",
                                                                                "positions_per_specialist")
    for key in keys:
        if not isinstance(poss.get(key), int) or isinstance(poss.get(key), bool) or poss[key] < 1:
            raise PosSServingError(f"poss.{key} must be a positive integer, got {poss.get(key)!r}")
    position_groups(poss)
    target = poss.get("target") or {}
    if drafter_type == "eagle" and target.get("model_type") not in EAGLE_FAMILIES:
        raise PosSServingError(
            f"poss_vllm serves EAGLE-1/2-style PosS drafters of {EAGLE_FAMILIES} targets; this one was built for a "
            f"{target.get('model_type')!r} target"
        )


# ---- which specialist drafts a position ----------------------------------------------------------------------------
def position_groups(poss: dict) -> list[int]:
    """How many consecutive draft positions each specialist serves: the export's `position_groups` (uneven groups,
    e.g. [1, 3, 4]) when written, else `positions_per_specialist` for every one of `num_specialists`."""
    count = poss.get("num_specialists")
    groups = poss.get("position_groups")
    if groups is None:
        return [poss["positions_per_specialist"]] * count
    if (not isinstance(groups, list) or len(groups) != count
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in groups)):
        raise PosSServingError(f"poss.position_groups must list a positive number of positions for each of the "
                               f"{count} specialists, got {groups!r}")
    return list(groups)


def specialist_for_position(position: int, groups: Sequence[int]) -> int:
    """The specialist drafting draft position `position` (1-based within a round): specialist `s` serves the
    `groups[s]` positions after those of the specialists before it; positions past them all, the last one. Uniform
    groups `[k] * n` give `min((position - 1) // k, n - 1)`."""
    if position < 1:
        raise ValueError(f"draft positions start at 1, got {position}")
    end = 0
    for specialist, size in enumerate(groups):
        end += size
        if position <= end:
            return specialist
    return len(groups) - 1


# ---- the model runner and graph capture ---------------------------------------------------------------------------
V2_RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def choose_v1_runner() -> None:
    """PosS drafters run under vLLM's V1 model runner, whose EAGLE proposer (`llm_base_proposer.py`) tells the drafter
    each draft step; Model Runner V2 (vLLM's default on GPUs with Triton, 0.32 and 0.33) drafts in
    `vllm/v1/worker/gpu/spec_decode`, which does not. Called when a PosS export's config is read (before the engine
    config is built): selects V1 when the variable is unset, refuses when it asks for V2."""
    value = os.environ.get(V2_RUNNER_VARIABLE)
    if _truthy(value):
        raise PosSServingError(
            f"PosS drafters are served by vLLM's V1 model runner (its EAGLE proposer, vllm/v1/spec_decode/"
            f"llm_base_proposer.py, tells the drafter each draft step; Model Runner V2's speculator does not), and "
            f"{V2_RUNNER_VARIABLE}={value} asks for V2: unset it or set it to 0"
        )
    if value is None:
        os.environ[V2_RUNNER_VARIABLE] = "0"  # inherited by the engine processes started after this
        logger.info("poss_vllm: a PosS drafter is served: %s=0 (vLLM's V1 model runner)", V2_RUNNER_VARIABLE)


def check_engine_mode(vllm_config, breakable_graphs: bool) -> None:
    """At model build: refuse Model Runner V2, and a CUDA graph captured around the drafter.

    The draft index is Python state the drafter reads at each call (`draft_index.py`). vLLM's V1 runner gives EAGLE
    drafters piecewise CUDA graphs only, which capture torch.compile'd submodules: the PosS models compile nothing, so
    their forward runs eagerly at every step with graphs on (the target keeps its graphs). Breakable CUDA graphs
    (`VLLM_USE_BREAKABLE_CUDAGRAPH=1`, on by default for some architectures) capture the drafter's whole forward and
    would replay one step's specialist at every step: refused unless the drafter is eager (`enforce_eager` in the
    speculative config)."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise PosSServingError(
            "This engine uses vLLM's Model Runner V2, whose speculator does not tell the drafter its draft step; PosS "
            f"drafters need the V1 runner: unset {V2_RUNNER_VARIABLE} or set it to 0"
        )
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    graphs = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
    if breakable_graphs and graphs and not vllm_config.speculative_config.enforce_eager:
        raise PosSServingError(
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 captures the drafter's whole forward in a CUDA graph, which would replay "
            "the specialist of the captured draft step at every step. Serve PosS drafters with an eager drafter "
            "(speculative config {\"enforce_eager\": true}; the target keeps its graphs) or "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=0."
        )


# ---- the batch-size schedule: stop drafting where it stops paying -------------------------------------------------
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def batch_schedule(max_batch_size: int, num_speculative_tokens: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` (inclusive batch-size ranges `[start, end, K]`, the first
    starting at 1, the last one's K carried to every larger batch): K draft tokens up to `max_batch_size` scheduled
    requests, none above (`max_batch_size` 0: none at any size)."""
    if max_batch_size <= 0:
        return [[1, 1, 0]]
    return [[1, max_batch_size, num_speculative_tokens], [max_batch_size + 1, max_batch_size + 1, 0]]


def read_export_config(folder) -> dict | None:
    """An export's config.json (a local folder, or a repository through transformers' cache), or None."""
    path = Path(str(folder)) / "config.json"
    try:
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        from transformers import PretrainedConfig

        return PretrainedConfig.get_config_dict(str(folder))[0]
    except Exception:  # not a folder or repository with a config: nothing to apply
        return None


def suggested_max_batch_size(poss: dict) -> int | None:
    suggestion = poss.get("speculative_config") or {}
    value = suggestion.get("max_batch_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def with_export_schedule(speculative: dict, user: dict | None) -> dict:
    """`speculative` (the config vLLM is about to build) with the PosS export's batch-size schedule, unless the user
    gave `num_speculative_tokens_per_batch_size` (null: no schedule) or the export suggests none."""
    if not isinstance(speculative, dict) or SCHEDULE_KEY in (user or {}) or SCHEDULE_KEY in speculative:
        return speculative
    config = read_export_config(speculative.get("model")) if speculative.get("model") else None
    poss = (config or {}).get("poss")
    if not isinstance(poss, dict) or poss.get("format") != FORMAT_NAME:
        return speculative
    limit = suggested_max_batch_size(poss)
    if limit is None:
        return speculative
    k = speculative.get("num_speculative_tokens") or poss["speculative_config"].get("num_speculative_tokens")
    schedule = batch_schedule(limit, int(k))
    logger.info("poss_vllm: %s=%s (the export's max_batch_size %d: drafting stops paying above it; pass %s in the "
                "speculative config to override)", SCHEDULE_KEY, schedule, limit, SCHEDULE_KEY)
    return {**speculative, SCHEDULE_KEY: schedule}


def speculative_config(folder, num_speculative_tokens: int | None = None, **overrides) -> dict:
    """The speculative config for `LLM(model=TARGET, speculative_config=...)` that serves the export in `folder`:
    its method, K (`num_speculative_tokens`, default the export's suggestion) and its batch-size schedule; keyword
    `overrides` go in as given (e.g. `num_speculative_tokens_per_batch_size=None` for none)."""
    config = read_export_config(folder)
    poss = (config or {}).get("poss")
    if not isinstance(poss, dict):
        raise PosSServingError(f"{folder} is not an export of `poss export --format vllm` (no poss block)")
    suggestion = poss.get("speculative_config") or {}
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = num_speculative_tokens or suggestion.get("num_speculative_tokens") or proposals[0].get("speculative_tokens")
    result = {"method": poss["drafter_type"], "model": str(folder), "num_speculative_tokens": int(k)}
    limit = suggested_max_batch_size(poss)
    if limit is not None:
        result[SCHEDULE_KEY] = batch_schedule(limit, int(k))
    result.update(overrides)
    return result


def _wrap_speculators_override(original):
    @functools.wraps(original)
    def maybe_override_with_speculators(model, tokenizer, *args, **kwargs):
        """vLLM's (a speculators folder as the model: its verifier is served), then the PosS export's batch-size
        schedule added to the speculative config, whichever way the export was named."""
        user = kwargs.get("vllm_speculative_config", args[2] if len(args) > 2 else None)
        model, tokenizer, speculative = original(model, tokenizer, *args, **kwargs)
        return model, tokenizer, with_export_schedule(speculative, user if isinstance(user, dict) else None)

    maybe_override_with_speculators.poss_wrapped = True
    return maybe_override_with_speculators


def install_schedule() -> None:
    """Wrap `maybe_override_with_speculators` where `EngineArgs.create_engine_config` calls it (the front-end process
    imports `vllm.engine.arg_utils` before the plugin registers; other processes get the built config)."""
    import sys

    for name in ("vllm.engine.arg_utils", "vllm.transformers_utils.config"):
        module = sys.modules.get(name)
        function = getattr(module, "maybe_override_with_speculators", None)
        if function is not None and not getattr(function, "poss_wrapped", False):
            module.maybe_override_with_speculators = _wrap_speculators_override(function)


# ---- the speculators types ----------------------------------------------------------------------------------------
def _eagle_updater(config_dict: dict, pre_trained_config: dict) -> None:
    """speculators type "eagle": a PosS EAGLE-1/2-style drafter (vLLM 0.32 and 0.33 have no speculators "eagle"
    type)."""
    check_vllm_version()
    poss = config_dict.get("poss")
    if poss is None:
        raise PosSServingError(
            "speculators_model_type 'eagle' is read by the poss_vllm plugin for PosS drafters only (a `poss` block "
            "written by `poss export --format vllm`); this config has none"
        )
    check_poss_block(poss, "eagle")
    choose_v1_runner()
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
        choose_v1_runner()
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
