"""Pipelines: `pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter)` drafts with a PosS
drafter, through the same `generate` hook as `target.generate(assistant_model=drafter)`.

transformers' `pipelines.base.load_assistant_model` compares the assistant's vocabulary size and special tokens with
the model's: a drafter's config reports those of the target it was trained for (`PosSConfig.eos_token_id`, ...). It
is wrapped once, so that with a PosS drafter it first refuses a drafter built for another target with the error
`generate` gives (`binding.check_compatible`), and loads a drafter folder or Hub id given as a string as a
`PosSDrafter` (transformers would load a causal LM and its tokenizer from it). Other assistants pass through unchanged.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..binding import check_compatible
from ..modeling_poss import PosSDrafter
from .hook import is_poss_drafter

_original: dict = {}


def names_poss_drafter(name_or_path: str) -> bool:
    """Whether the folder or Hub repo `name_or_path` holds a native PosS drafter (its config's `model_type`)."""
    try:
        config, _ = PretrainedConfig.get_config_dict(name_or_path)
    except (OSError, ValueError):  # not a model folder or repo: transformers' loader says why
        return False
    return config.get("model_type") == "poss"


def _poss_load_assistant_model(model, assistant_model, assistant_tokenizer):
    """`load_assistant_model` with a PosS drafter: checked against the pipeline's model before any work."""
    if model.can_generate():  # else transformers ignores the assistant
        if isinstance(assistant_model, str) and names_poss_drafter(assistant_model):
            assistant_model = PosSDrafter.from_pretrained(assistant_model)
        if is_poss_drafter(assistant_model):
            check_compatible(assistant_model, model)
    return _original["load_assistant_model"](model, assistant_model, assistant_tokenizer)


def install_pipeline_hook() -> None:
    """Wrap `transformers.pipelines.base.load_assistant_model` (idempotent)."""
    if _original:
        return
    from transformers.pipelines import base

    _original["load_assistant_model"] = base.load_assistant_model
    base.load_assistant_model = _poss_load_assistant_model
