"""Load EAGLE-1/2, HASS and PosS research checkpoints as native `PosSDrafter`s.

**Research layout** (the `Model` class of the EAGLE code, which HASS and PosS reuse), one folder or Hub repo:

- `config.json`: a Llama config of the draft model (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
  `intermediate_size`, `rms_norm_eps`, `rope_theta`, `rope_scaling`, `vocab_size`, `num_hidden_layers`, ...) and an
  optional `bias` (whether `fc` has a bias; the research code's default when absent is `True`);
- `model.safetensors` or `pytorch_model.bin` (one file, not sharded) holding, for layers `i`:
  `fc.weight [H, 2H]`, `fc.bias [H]` (when `bias`), `embed_tokens.weight [V, H]`,
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
  `layers.{i}.post_attention_layernorm.weight`.

**What the conversion does, and where the research code differs from a native drafter:**

1. `fc`: the research forward is `fc(cat((embed_tokens(x_{t+1}), f_t), dim=-1))`, embedding first: the same order
   as the native `PosSDrafter.project`, so `fc.weight`/`fc.bias` are copied unchanged.
2. Token embedding: the research checkpoint stores `embed_tokens.weight`, a frozen copy of the target's input
   embedding (the research code loads it from the base model and never trains it). A native drafter stores no
   embedding and uses its bound target's. The conversion drops the stored copy; `convert_research_checkpoint(...,
   target=...)` (`poss convert --target`) first checks that it equals the target's embedding (up to bf16 rounding),
   since a drafter bound to a target with another embedding drafts differently.
3. Layers: `layers.{i}.*` become `specialists.{i}.*` unchanged: attention, SwiGLU MLP and post-attention RMSNorm,
   with no norm before attention in either (the research layer 0 has none; the PosS code removes it for every
   specialist; native specialists use `Identity`). RoPE, GQA and RMSNorm are transformers' Llama implementations of
   the same config values (`rope_theta`, `rope_scaling` linear/dynamic, `rms_norm_eps`).
4. `input_layernorm`: the EAGLE/HASS layer class creates `layers.{i}.input_layernorm` for `i > 0` (it is used only
   when layers run stacked). A checkpoint holding any `input_layernorm` weight is **refused**: native specialists have
   no norm before attention, and dropping the weights would silently change the drafts.
5. Layer count: EAGLE runs its `num_hidden_layers` layers in sequence (a stack); PosS runs *one* layer per draft
   position and its `config.json` does not say how many layers or positions per layer it has (the PosS code takes
   `forward_num_total // position_per_layer` from the command line). So without `num_specialists` the checkpoint must
   be a single-layer EAGLE/HASS drafter (`num_hidden_layers` 1; stacked drafters are refused); with
   `num_specialists` (or a known preset, `POSS_PRESETS`) its weights must hold exactly that many layers.
6. Position to specialist: the PosS code drafts depth `d` (0-based, after the root) with layer
   `min((d + 1) // position_per_layer, layers - 1)`, which is the native `min((p - 1) // k, n - 1)` for position
   `p = d + 2`; position 1 uses layer 0 in both.
7. Config: the research config becomes `PosSConfig.target_config` (model_type `llama`); the generation settings
   (draft mode, tree budget) take `PosSGenerationConfig`'s defaults unless given; `training_record` says where the
   weights came from.

EAGLE-3 layouts (SafeAILab, SpecForge / SpecBundle, speculators, PosS on EAGLE-3) have their own reader and layout
table, with the reference sources: `transformers_poss.checkpoints.eagle3`.

Safety: `pytorch_model.bin` is read with `torch.load(weights_only=True)` only; a pickle that needs anything but
tensors is refused. Missing, extra or mis-shaped weights are a `ValueError` listing the keys, never a partial load.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..configuration_poss import PosSConfig
from ..generation_config import PosSGenerationConfig
from ..modeling_poss import PosSDrafter
from .native import HUB_KWARGS

RESEARCH_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
RESEARCH_LAYOUT_NAMES = ("EAGLE-1/2", "HASS", "PosS")

_LLAMA_3_8B_INSTRUCT = "meta-llama/Meta-Llama-3-8B-Instruct"
_LLAMA_2_13B_CHAT = "meta-llama/Llama-2-13b-chat-hf"
# Hub repo id (lower case) -> (num_specialists, positions_per_specialist, target). PosS checkpoints do not record these.
# From shrango/PosS: `spec_decode.py` `determine_poss_settings` gives each repo's (forward_num_total,
# position_per_layer): Llama-3-8B-Instruct PosS-1/2/3 (7, 1), (8, 2), (12, 3); Llama-2-13B-Chat (6, 1), (6, 2), (6, 3)
# (`train_poss.sh`: Llama-2-13B PosS-3 trained with 6, 3); `model/cnets_poss_layer.py` and `cnets_poss_layer_gen.py`
# build `layer_num = forward_num_total // position_per_layer` layers, and the latter drafts depth i (position i + 2)
# with layer `min((1 + i) // position_per_layer, layer_num - 1)`, i.e. `PosSConfig.specialist_for_position`.
POSS_PRESETS = {
    "hint-lab/poss1-llama3-8b-instruct": (7, 1, _LLAMA_3_8B_INSTRUCT),
    "hint-lab/poss2-llama3-8b-instruct": (4, 2, _LLAMA_3_8B_INSTRUCT),
    "hint-lab/poss3-llama3-8b-instruct": (4, 3, _LLAMA_3_8B_INSTRUCT),
    "hint-lab/poss1-llama2-13b-chat": (6, 1, _LLAMA_2_13B_CHAT),
    "hint-lab/poss2-llama2-13b-chat": (3, 2, _LLAMA_2_13B_CHAT),
    "hint-lab/poss3-llama2-13b-chat": (2, 3, _LLAMA_2_13B_CHAT),
}

# Keys of the research config copied into the native `target_config` (the Llama layer needs nothing else).
_LLAMA_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
    "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act", "initializer_range",
    "pad_token_id", "bos_token_id", "eos_token_id",
)
_LOAD_KWARGS = ("dtype", "torch_dtype", "device_map", "attn_implementation")
_CONFIG_OVERRIDES = ("target_name_or_path",)
_GENERATION_OVERRIDES = tuple(PosSGenerationConfig.POSS_DEFAULTS)
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


@dataclass
class ResearchCheckpoint:
    """A research checkpoint read from disk: its config, its tensors and where they came from."""

    source: str
    folder: Path
    config: dict
    weights_file: str
    state_dict: dict[str, torch.Tensor] = field(repr=False)

    @property
    def layer_indices(self) -> list[int]:
        return sorted({int(m.group(1)) for key in self.state_dict if (m := _LAYER_KEY.match(key))})

    @property
    def fc_bias(self) -> bool:
        return bool(self.config.get("bias", True))


# ---- finding and reading ------------------------------------------------------------------------------------------
def preset_for(path_or_id: str | os.PathLike) -> tuple[int, int, str] | None:
    """`(num_specialists, positions_per_specialist, target)` of a known PosS repo id (or its Hub cache folder)."""
    text = str(path_or_id).replace("\\", "/").strip("/")
    if text.lower() in POSS_PRESETS:
        return POSS_PRESETS[text.lower()]
    for part in text.split("/"):  # a Hub cache snapshot: .../models--HINT-lab--PosS2-Llama3-8B-Instruct/snapshots/...
        if part.startswith("models--") and part.count("--") == 2:
            repo_id = part[len("models--"):].replace("--", "/").lower()
            if repo_id in POSS_PRESETS:
                return POSS_PRESETS[repo_id]
    return None


def _read_config(path_or_id: str | os.PathLike, **hub_kwargs) -> dict | None:
    """The `config.json` of a local folder or Hub repo, or `None` when there is none (or it cannot be fetched)."""
    local = Path(path_or_id) / (hub_kwargs.get("subfolder") or "")
    if local.is_dir():
        path = local / "config.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    from transformers.utils import cached_file

    try:
        resolved = cached_file(
            str(path_or_id), "config.json", _raise_exceptions_for_missing_entries=False,
            **{k: v for k, v in hub_kwargs.items() if k in HUB_KWARGS and v is not None},
        )
    except (OSError, ValueError):  # not a repo id, offline and not cached, ...: the native loader reports it
        return None
    return json.loads(Path(resolved).read_text(encoding="utf-8")) if resolved else None


def is_research_checkpoint(path_or_id: str | os.PathLike, **hub_kwargs) -> bool:
    """Whether `path_or_id` holds a research-layout drafter: a `config.json` whose `model_type` is not `"poss"`."""
    config = _read_config(path_or_id, **hub_kwargs)
    return config is not None and config.get("model_type") != PosSConfig.model_type


def _resolve_folder(path_or_id: str | os.PathLike, **hub_kwargs) -> Path:
    """A local folder with the research files: `path_or_id` itself, or a Hub snapshot of just those files."""
    subfolder = hub_kwargs.get("subfolder") or ""
    local = Path(path_or_id)
    if local.is_dir():
        return local / subfolder
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/{name}".lstrip("/") for name in ("config.json", *RESEARCH_WEIGHT_FILES)]
    folder = snapshot_download(
        str(path_or_id), allow_patterns=patterns,
        **{k: v for k, v in hub_kwargs.items() if k in HUB_KWARGS and k != "subfolder" and v is not None},
    )
    return Path(folder) / subfolder


def load_pickled_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a `pytorch_model.bin` with `torch.load(weights_only=True)`; refuse pickles that need any code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(
            f"Refusing to load {path}: it is a pickle that needs more than tensors to load (only "
            f"`torch.load(weights_only=True)` is allowed, and it refused this file). Convert the checkpoint to "
            f"safetensors with code you trust. ({first_line})"
        ) from None
    except (RuntimeError, EOFError) as error:
        raise ValueError(f"{path} is not a readable torch checkpoint: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ValueError(f"{path} does not hold a flat state dict of named tensors (got {type(state).__name__})")
    return state


def read_research_checkpoint(path_or_id: str | os.PathLike, **hub_kwargs) -> ResearchCheckpoint:
    """Read the config and tensors of a research checkpoint (local folder, or Hub repo id via `snapshot_download`)."""
    folder = _resolve_folder(path_or_id, **hub_kwargs)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path_or_id} has no config.json: it is not an EAGLE/HASS/PosS research checkpoint")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for name in RESEARCH_WEIGHT_FILES:  # safetensors first: it needs no pickle at all
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                state = load_file(str(path), device="cpu")
            else:
                state = load_pickled_tensors(path)
            return ResearchCheckpoint(str(path_or_id), folder, config, name, state)
    sharded = [p.name for p in folder.glob("*.index.json")]
    raise ValueError(
        f"{path_or_id} holds none of {RESEARCH_WEIGHT_FILES}"
        + (f" (sharded checkpoints such as {sharded} are not supported for drafters)" if sharded else "")
    )


# ---- checking and converting --------------------------------------------------------------------------------------
def research_target_config(research_config: dict) -> dict:
    """The native `target_config` (a Llama text config dict) described by a research `config.json`."""
    model_type = research_config.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"Research drafters are Llama layers; this config.json says model_type={model_type!r}. Only Llama-layer "
            f"EAGLE/HASS/PosS checkpoints can be converted."
        )
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if not research_config.get(k)]
    if missing:
        raise ValueError(f"The research config.json lacks {missing}: the drafter layers cannot be rebuilt")
    from transformers import LlamaConfig

    fields = {k: research_config[k] for k in _LLAMA_FIELDS if research_config.get(k) is not None}
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = dict(fields["rope_scaling"])  # LlamaConfig edits the dict it is given
    return LlamaConfig(**fields, attention_bias=False, mlp_bias=False).to_dict()


def _native_key(research_key: str) -> str:
    return "specialists." + research_key[len("layers."):] if research_key.startswith("layers.") else research_key


def _research_key(native_key: str) -> str:
    return "layers." + native_key[len("specialists."):] if native_key.startswith("specialists.") else native_key


def expected_research_shapes(config: PosSConfig) -> dict[str, tuple[int, ...]]:
    """Research key -> shape for a drafter with `config` (from the native model's own state dict, built on meta)."""
    with torch.device("meta"):
        model = PosSDrafter(config)
    shapes = {_research_key(k): tuple(v.shape) for k, v in model.state_dict().items()}
    shapes["embed_tokens.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def _listing(keys, limit: int = 24) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_research_weights(checkpoint: ResearchCheckpoint, config: PosSConfig) -> None:
    """Raise `ValueError` listing every missing, extra or mis-shaped key (against `config`)."""
    state = checkpoint.state_dict
    norms = [k for k in state if k.endswith("input_layernorm.weight")]
    if norms:
        raise ValueError(
            f"{checkpoint.source} has input norms before attention ({_listing(norms)}). PosS specialists run without "
            "that norm (EAGLE uses it only for stacked layers i > 0), and dropping it would change the drafts: "
            "this checkpoint cannot be converted."
        )
    if any(k.startswith("midlayer.") for k in state) or {"d2t", "t2d"} & set(state):
        raise ValueError(
            f"{checkpoint.source} looks like an EAGLE-3 checkpoint (midlayer / d2t / t2d) whose config.json has no "
            "draft_vocab_size: add it (the rows of lm_head.weight) so the EAGLE-3 reader (`checkpoints.eagle3`) takes it"
        )
    if any(k.startswith("model.layers.") for k in state):
        raise ValueError(f"{checkpoint.source} looks like a full causal LM (keys 'model.layers.*'), not a drafter")
    expected = expected_research_shapes(config)
    problems = tensor_problems(state, expected)
    if not problems:
        return
    hint = ""
    found = checkpoint.layer_indices
    if len(found) != config.num_specialists:
        hint = (
            f" The weights hold {len(found)} layer(s) ({found}) and the drafter expects {config.num_specialists}: a "
            "PosS checkpoint needs `num_specialists` and `positions_per_specialist` (they are not in its config.json)."
        )
    elif ("fc.bias" in state) != ("fc.bias" in expected):
        hint = f" config.json says bias={checkpoint.fc_bias}; the fc bias in the weights disagrees."
    raise ValueError(f"{checkpoint.source} does not match its config: " + "; ".join(problems) + "." + hint)


def tensor_problems(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                    optional: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """What is wrong with a checkpoint's tensors against the `expected` names and shapes (`optional` ones may be
    absent): missing, unexpected and mis-shaped tensors, each as one phrase; empty when nothing is."""
    optional = optional or {}
    missing = set(expected) - set(state)
    extra = set(state) - set(expected) - set(optional)
    wrong = {k: (tuple(state[k].shape), shape) for k, shape in {**expected, **optional}.items()
             if k in state and tuple(state[k].shape) != shape}
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    if wrong:
        problems.append("wrong shapes: " + ", ".join(f"{k} has {got}, expected {want}"
                                                     for k, (got, want) in sorted(wrong.items())))
    return problems


def research_poss_config(
    checkpoint: ResearchCheckpoint, num_specialists: int | None = None, positions_per_specialist: int | None = None,
    **overrides,
) -> PosSConfig:
    """The native config of a research checkpoint, with the specialist settings given or known for its repo."""
    preset = preset_for(checkpoint.source)
    if preset is not None:
        num_specialists = preset[0] if num_specialists is None else num_specialists
        positions_per_specialist = preset[1] if positions_per_specialist is None else positions_per_specialist
        overrides.setdefault("target_name_or_path", preset[2])
    if num_specialists is None:
        layers = checkpoint.config.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(
                f"{checkpoint.source} is a stacked EAGLE drafter (num_hidden_layers={layers}, run in sequence), which "
                "a PosS drafter cannot run. If its layers are PosS specialists, pass num_specialists and "
                "positions_per_specialist."
            )
        num_specialists = 1
    if positions_per_specialist is None:
        if num_specialists > 1:
            raise ValueError(
                f"Pass positions_per_specialist (the k of PosS-k) with num_specialists={num_specialists}: PosS "
                "checkpoints do not record it."
            )
        positions_per_specialist = 1
    return PosSConfig(
        target_config=research_target_config(checkpoint.config),
        num_specialists=num_specialists,
        positions_per_specialist=positions_per_specialist,
        fc_bias=checkpoint.fc_bias,
        **overrides,
    )


def conversion_record(checkpoint: ResearchCheckpoint) -> dict:
    """The converted drafter's `training_record`: where its weights came from."""
    return {
        "converted_from": checkpoint.source,
        "source_layout": "research checkpoint (" + " / ".join(RESEARCH_LAYOUT_NAMES) + ")",
        "source_weights": checkpoint.weights_file,
        "source_dtype": str(checkpoint.state_dict["fc.weight"].dtype).replace("torch.", "")
        if "fc.weight" in checkpoint.state_dict else None,
        "dropped_keys": ["embed_tokens.weight (the target's embedding is used)"],
    }


def native_state_dict(checkpoint: ResearchCheckpoint) -> dict[str, torch.Tensor]:
    """`layers.{i}.*` -> `specialists.{i}.*`, `fc.*` unchanged, `embed_tokens.weight` dropped (see the module doc)."""
    return {_native_key(k): v for k, v in checkpoint.state_dict.items() if k != "embed_tokens.weight"}


def check_embedding_matches(
    stored: torch.Tensor, target_embedding: torch.Tensor, source: str = "the checkpoint",
) -> None:
    """Raise `ValueError` unless the stored `embed_tokens` equals the target's embedding up to bf16 rounding."""
    if tuple(stored.shape) != tuple(target_embedding.shape):
        raise ValueError(
            f"{source} stores an embedding of shape {tuple(stored.shape)} but the target's is "
            f"{tuple(target_embedding.shape)}: the drafter was trained for another target"
        )
    a, b = stored.float(), target_embedding.float().to(stored.device)
    off = (a - b).abs() > (2.0 ** -7) * b.abs() + 1e-6
    if off.any():
        rows = off.any(dim=-1).sum().item()
        raise ValueError(
            f"{source} stores an embedding that differs from the target's in {rows} of {a.shape[0]} rows (max abs "
            f"difference {(a - b).abs().max().item():.3g}): the drafter was trained for another target, and it would "
            "draft differently with this one."
        )


def target_input_embedding(target) -> torch.Tensor:
    """The input embedding `[V, H]` of a target model object, or read from a local folder's safetensors files."""
    if hasattr(target, "get_input_embeddings"):
        return target.get_input_embeddings().weight.detach()
    folder = Path(target)
    if not folder.is_dir():
        raise ValueError(f"--target must be a local model folder or a model object, got {target!r}")
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names = [k for k in handle.keys() if k.endswith("embed_tokens.weight")]
            if names:
                return handle.get_tensor(sorted(names, key=len)[0])
    raise ValueError(f"No '*embed_tokens.weight' tensor in the safetensors files of {folder}")


def load_research_drafter(
    cls, path_or_id: str | os.PathLike, num_specialists: int | None = None,
    positions_per_specialist: int | None = None, target=None, **kwargs,
):
    """Build a `cls` (a `PosSDrafter`) from a research checkpoint; see the module docstring for the conversion.

    Args:
        path_or_id: local folder or Hub repo id.
        num_specialists / positions_per_specialist: the PosS settings (known for the `POSS_PRESETS` repos).
        target: optional target model (object or local folder) whose embedding must match the stored one.
        kwargs: hub options (`cache_dir`, `revision`, `token`, `local_files_only`, `force_download`, `subfolder`),
            loading options (`dtype`, default the checkpoint's; `device_map`; `attn_implementation`), the config
            override `target_name_or_path` and generation settings (`PosSGenerationConfig` fields, e.g. `tree_depth`).
    """
    supported = HUB_KWARGS + _LOAD_KWARGS + _CONFIG_OVERRIDES + _GENERATION_OVERRIDES
    unknown = set(kwargs) - set(supported)
    if unknown:
        raise ValueError(
            f"Options {sorted(unknown)} are not supported when loading a research checkpoint; supported: "
            f"{sorted(supported)}"
        )
    hub_kwargs = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
    overrides = {k: kwargs.pop(k) for k in _CONFIG_OVERRIDES if k in kwargs}
    generation = {k: kwargs.pop(k) for k in _GENERATION_OVERRIDES if k in kwargs}
    checkpoint = read_research_checkpoint(path_or_id, **hub_kwargs)
    config = research_poss_config(checkpoint, num_specialists, positions_per_specialist, **overrides)
    check_research_weights(checkpoint, config)
    if target is not None:
        stored = checkpoint.state_dict["embed_tokens.weight"]
        check_embedding_matches(stored, target_input_embedding(target), checkpoint.source)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or "auto"
    if dtype == "auto":
        dtype = checkpoint.state_dict["fc.weight"].dtype
    model, info = cls.from_pretrained(
        None, config=config, state_dict=native_state_dict(checkpoint), dtype=dtype, output_loading_info=True, **kwargs,
    )
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:  # checked above; never partial
        raise ValueError(f"Converting {checkpoint.source} left keys unmatched: {info}")
    model.generation_config = PosSGenerationConfig.from_dict(generation)  # the drafter's budget
    model.training_record = conversion_record(checkpoint)
    return model


def read_if_research_checkpoint(cls, path_or_id, *model_args, num_specialists=None, positions_per_specialist=None,
                                **kwargs):
    """The `checkpoints.loading.CHECKPOINT_READERS` entry: a converted drafter when `path_or_id` is a research checkpoint,
    else `None` (a native folder, or nothing readable: the native loader then reports it)."""
    if not is_research_checkpoint(path_or_id, **kwargs):
        return None
    if model_args:
        raise ValueError("positional model arguments are not supported for research checkpoints")
    return load_research_drafter(cls, path_or_id, num_specialists=num_specialists,
                                 positions_per_specialist=positions_per_specialist, **kwargs)


def convert_research_checkpoint(
    source: str | os.PathLike, destination: str | os.PathLike, num_specialists: int | None = None,
    positions_per_specialist: int | None = None, target=None, overwrite: bool = False, **kwargs,
):
    """Write a native PosSDrafter folder (safetensors, config.json, generation_config.json, training_record.json) from
    a research checkpoint. Returns the converted drafter. `destination` must be absent or empty unless `overwrite`.
    """
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())) and not overwrite:
        raise ValueError(f"{destination} exists and is not empty; choose another folder or pass overwrite=True")
    drafter = load_research_drafter(
        PosSDrafter, source, num_specialists=num_specialists, positions_per_specialist=positions_per_specialist,
        target=target, **kwargs,
    )
    drafter.save_pretrained(destination)
    return drafter
