"""`speculative_generate`: PosS speculative decoding as one function, the one a drafter folder's
`custom_generate/generate.py` calls, so that

    target.generate(**inputs, custom_generate=DRAFTER_FOLDER_OR_REPO, trust_remote_code=True)

drafts with the drafter stored there, in the same loop as `target.generate(**inputs, assistant_model=drafter)`.

transformers hands a `custom_generate` function every argument of `generate` except the `custom_generate` string
itself, and runs a copy of the file from its modules cache (so the file's `__file__` does not name the folder): the
folder or repo id is read from the `generate` call in progress, the caller of that function.
"""

from __future__ import annotations

import inspect
import os

from transformers.generation.utils import GenerationMixin

from ..checkpoints.native import HUB_KWARGS
from ..modeling_poss import PosSDrafter
from .hook import is_poss_drafter

_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def speculative_generate(model, drafter=None, **generate_kwargs):
    """`model.generate(**generate_kwargs, assistant_model=drafter)`: PosS speculative decoding (the tree or chain loop
    of the `generate` hook), with `generate`'s outputs (`speculative_stats` with `return_dict_in_generate=True`).

    Args:
        model: the target, a transformers causal LM.
        drafter: a `PosSDrafter`; a drafter folder or Hub repo id, loaded with `PosSDrafter.from_pretrained` on
            every call (with `cache_dir`, `revision`, `token`... from `generate_kwargs`; to decode many times, load it
            once and pass the drafter); or None inside `model.generate(custom_generate=DRAFTER_FOLDER_OR_REPO,
            trust_remote_code=True)`: the drafter stored in that folder or repo.
        generate_kwargs: what `generate` takes: inputs (`input_ids`, `attention_mask`), `max_new_tokens`,
            `do_sample`, `streamer`, `return_dict_in_generate`, ...
    """
    hub_kwargs = {name: generate_kwargs.pop(name) for name in HUB_KWARGS if name in generate_kwargs}
    if drafter is None:
        drafter = custom_generate_source()
    if isinstance(drafter, (str, os.PathLike)):
        drafter = PosSDrafter.from_pretrained(drafter, **hub_kwargs).eval()
    if not is_poss_drafter(drafter):
        raise ValueError(f"speculative_generate drafts with a PosS drafter, got {type(drafter).__name__}")
    return model.generate(**generate_kwargs, assistant_model=drafter)


def custom_generate_source() -> str:
    """The `custom_generate` folder or Hub repo id of the `model.generate(custom_generate=...)` call in progress;
    `ValueError` outside one."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is _GENERATE_CODE and isinstance(frame.f_locals.get("custom_generate"), str):
                return frame.f_locals["custom_generate"]
            frame = frame.f_back
    finally:
        del frame  # a frame held by a local of its own keeps a reference cycle
    raise ValueError(
        "speculative_generate needs a drafter: pass a PosSDrafter, a drafter folder or Hub repo id, or call it through "
        "target.generate(custom_generate=DRAFTER_FOLDER_OR_REPO, trust_remote_code=True)"
    )
