"""The one `generate()` hook: lets `target.generate(..., assistant_model=drafter)` draft with a PosS drafter.

transformers picks its candidate generator from a fixed chain with no registry, and its assisted loop verifies one
chain only. Three `GenerationMixin` methods are wrapped. Each wrapper reports the original's exact signature
(`generate()` forwards `inputs_tensor` only to a decoding method whose signature names it) and calls the original
unchanged unless the assistant is a PosS drafter (recognised by `is_poss_drafter` / `config.model_type == "poss"`,
not by class, so remote-code loads work too). With a PosS drafter:

- `_validate_generation_mode`: checks the request before any work (target compatibility, unsupported options);
- `_assisted_decoding`: resolves the drafter's budget for the device kind (`resolve_budget`), decodes plainly where
  it says speculation does not pay, else checks the inputs, binds the drafter, and runs the tree loop (`decoding`) for
  `draft_mode="tree"`, for one prompt or a batch;
- `_get_candidate_generator`: returns `PosSCandidateGenerator` for `draft_mode="chain"`.

The originals stay in `_originals`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import warnings

import transformers
from packaging import version
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from ..binding import check_compatible
from ..devices import device_kind
from ..generation_config import DRAFTER_DEFAULT, TREE_BUDGET_KEYS, resolve_budget
from .cache_surgery import has_sliding_window
from .candidate_generator import PosSCandidateGenerator
from .decoding import left_padding, tree_assisted_decoding
from .stats import BudgetUsed, GenerationStats, PosSGenerateOutput

MIN_TRANSFORMERS = "5.24.0"
MAX_TRANSFORMERS_EXCLUSIVE = "6.0.0"

# The parameters each hooked method must take by keyword: the wrapper finds the assistant through them and the PosS
# branches read or forward them ("**": a catch-all for model kwargs such as `attention_mask` and `cache`).
_HOOKED = {
    "_validate_generation_mode": ("generation_mode", "generation_config", "generation_mode_kwargs"),
    "_assisted_decoding": (
        "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
        "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer", "**",
    ),
    "_get_candidate_generator": ("generation_config", "logits_processor", "assistant_model"),
}
# What the plain fallback calls unhooked (above a device kind's `max_batch_size`): transformers' own decoding loop.
_CALLED = {"_sample": ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus",
                       "streamer", "**")}
_originals: dict = {}
# The chain-mode candidate generator of the `generate` call in progress (set around transformers' assisted loop).
_chain_generator: contextvars.ContextVar = contextvars.ContextVar("poss_chain_generator", default=None)


def is_poss_drafter(model) -> bool:
    """Whether `model` is a PosS drafter (by attribute or config model type)."""
    if model is None:
        return False
    return bool(getattr(model, "is_poss_drafter", False)) or getattr(getattr(model, "config", None), "model_type", None) == "poss"


def check_transformers_version() -> None:
    """Raise `ImportError` with a clear message if this transformers cannot host the hook."""
    installed = version.parse(transformers.__version__)
    if not version.parse(MIN_TRANSFORMERS) <= installed < version.parse(MAX_TRANSFORMERS_EXCLUSIVE):
        raise ImportError(
            f"transformers-poss supports transformers >={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE}; "
            f"transformers {transformers.__version__} is installed. Install a supported version, e.g. "
            f"pip install 'transformers>={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE}'."
        )
    for name, needed in {**_HOOKED, **_CALLED}.items():
        method = _originals.get(name) or getattr(GenerationMixin, name, None)
        missing = list(needed) if method is None else _not_taken_by_keyword(method, needed)
        if missing:
            raise ImportError(
                f"transformers {transformers.__version__} changed GenerationMixin.{name}, which transformers-poss "
                f"{'hooks' if name in _HOOKED else 'calls'} (it no longer takes {', '.join(missing)}); install a "
                "supported transformers version."
            )


def _not_taken_by_keyword(method, needed) -> list[str]:
    """The names in `needed` that `method` cannot take by keyword ("**": it has no `**kwargs` catch-all)."""
    parameters = inspect.signature(method).parameters.values()
    taken = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        taken.add("**")
    return [name for name in needed if name not in taken]


def _unsupported_options(generation_config, generation_mode_kwargs) -> list[str]:
    """The `generate` options set in this call that a PosS drafter cannot honour yet, each described in words."""
    problems = []
    if (generation_config.num_beams or 1) > 1:
        problems.append(f"num_beams={generation_config.num_beams} (beam search)")
    if (generation_config.num_return_sequences or 1) > 1:
        problems.append(f"num_return_sequences={generation_config.num_return_sequences}")
    if generation_config.return_dict_in_generate and generation_config.output_attentions:
        problems.append("output_attentions=True")
    if generation_config.return_dict_in_generate and generation_config.output_hidden_states:
        problems.append("output_hidden_states=True")
    if generation_config.prompt_lookup_num_tokens is not None:
        problems.append("prompt_lookup_num_tokens (prompt lookup is another assistant)")
    if generation_config.cache_implementation not in (None, "dynamic"):
        problems.append(f"cache_implementation={generation_config.cache_implementation!r} (only the dynamic cache)")
    if generation_mode_kwargs.get("synced_gpus"):
        problems.append("synced_gpus=True")
    if generation_mode_kwargs.get("assistant_tokenizer") is not None:
        problems.append("assistant_tokenizer (a PosS drafter shares the target's vocabulary)")
    return problems


def validate_request(target, drafter, generation_config, generation_mode_kwargs) -> None:
    """All checks that can run before any forward pass; raises `ValueError`."""
    drafter.generation_config.validate()
    check_compatible(drafter, target)
    problems = _unsupported_options(generation_config, generation_mode_kwargs)
    if problems:
        raise ValueError("generate() with a PosS drafter does not support: " + "; ".join(problems))


def check_sliding_window(target, drafter, prompt_length: int, max_length: int) -> None:
    """Tree verification compacts the KV cache; on sliding-window layers that is exact only inside the window."""
    settings = drafter.generation_config
    if settings.draft_mode != "tree":
        return
    window = getattr(target.config.get_text_config(), "sliding_window", None)
    if has_sliding_window(target) and window is not None:
        needed = max(max_length, prompt_length) + settings.tree_total_tokens + settings.lookup_num_tokens
        if needed > window:
            raise ValueError(
                f"This target has sliding-window layers (window {window}); tree verification is exact only while "
                f"max_length + tree_total_tokens + lookup_num_tokens ({needed}) stays within the window. Lower "
                "max_new_tokens, or use draft_mode='chain'."
            )


def _poss_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    """PosS checks before any work, then transformers' own."""
    validate_request(self, generation_mode_kwargs["assistant_model"], generation_config, generation_mode_kwargs)
    return _originals["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


class UntunedDeviceWarning(UserWarning):
    """A drafter has no tuned budget for the device kind it drafts on (`PosSGenerationConfig.device_budgets`)."""


def _poss_assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """Check the inputs (`input_ids` is `[B, prompt_len]`), resolve the drafter's budget for this device kind
    (`resolve_budget`), and decode plainly where it says speculation does not pay; else bind the drafter to this target
    for the call and run the chain or the tree loop."""
    configured = kwargs["assistant_model"].generation_config
    kind = device_kind(self.device, self.dtype)
    settings, sources = resolve_budget(configured, kind)
    if kind not in configured.device_budgets and any(sources[name] == DRAFTER_DEFAULT for name in TREE_BUDGET_KEYS):
        warnings.warn(  # one text per kind: Python shows it once
            f"This PosS drafter has no budget tuned for {kind} and drafts with its default budget; `poss tune "
            "DRAFTER_FOLDER --prompts ...` on this device measures and writes one.", UntunedDeviceWarning,
            stacklevel=4,
        )
    # This call's settings: every budget value as resolved, what the drafting loops read.
    call_settings = configured.updated(**settings)
    reason = call_settings.plain_reason(kind, input_ids.shape[0])
    if reason is not None:
        out = _decode_plainly(self, input_ids, logits_processor, stopping_criteria, generation_config,
                              call_settings, reason, **kwargs)
    else:
        out = _decode(self, input_ids, logits_processor, stopping_criteria, generation_config, call_settings, **kwargs)
    if isinstance(out, PosSGenerateOutput) and out.speculative_stats is not None:
        out.speculative_stats.budget = BudgetUsed(kind, settings, sources)
    return out


def _decode_plainly(self, input_ids, logits_processor, stopping_criteria, generation_config, settings, reason,
                    **kwargs):
    """transformers' own decoding loop (`_sample`) on what generate prepared: plain `generate`'s output; the
    statistics say why nothing was drafted."""
    for unused in ("assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer"):
        kwargs.pop(unused, None)
    out = self._sample(input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
    if not isinstance(out, GenerateDecoderOnlyOutput):
        return out
    stats = GenerationStats(draft_mode=settings.draft_mode, tree_depth=settings.tree_depth, plain_reason=reason,
                            new_tokens=out.sequences.shape[1] - input_ids.shape[1])
    return PosSGenerateOutput(**out, speculative_stats=stats)


def _decode(self, input_ids, logits_processor, stopping_criteria, generation_config, call_settings, **kwargs):
    """Draft for this target (`self`) with the assistant bound to it for this call, on `call_settings`."""
    drafter = kwargs["assistant_model"].bind(self, generation_config=call_settings)
    drafter.eval()
    attention_mask = kwargs.get("attention_mask")
    _check_batch_request(drafter, generation_config, input_ids.shape[0], attention_mask, kwargs.get("streamer"))
    check_sliding_window(self, drafter, input_ids.shape[1], generation_config.max_length)
    if drafter.generation_config.draft_mode == "chain":
        # transformers' own loop asks `_get_candidate_generator` for the generator; it gets this one, whose
        # statistics then travel on the output.
        generator = PosSCandidateGenerator(drafter, generation_config, logits_processor)
        token = _chain_generator.set(generator)
        try:
            out = _originals["_assisted_decoding"](
                self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs
            )
        finally:
            _chain_generator.reset(token)
        if isinstance(out, GenerateDecoderOnlyOutput):
            return PosSGenerateOutput(**out, speculative_stats=generator.stats)
        return out
    kwargs.pop("assistant_model")
    for unused in ("inputs_tensor", "assistant_tokenizer", "tokenizer", "synced_gpus"):
        kwargs.pop(unused, None)
    return tree_assisted_decoding(
        self, input_ids, logits_processor, stopping_criteria, generation_config, drafter, **kwargs
    )


def _check_batch_request(drafter, generation_config, batch_size: int, attention_mask, streamer) -> None:
    """What a batch (or a padded prompt) cannot do, refused before any work with the alternative named."""
    padded = attention_mask is not None and not bool(attention_mask.all())
    problems = []
    if drafter.generation_config.draft_mode != "tree" and (batch_size > 1 or padded):
        problems.append(
            f"draft_mode={drafter.generation_config.draft_mode!r} (it verifies one unpadded prompt; use "
            "draft_mode='tree', e.g. assistant_model=drafter.with_generation_config(draft_mode='tree'))"
        )
    if batch_size > 1 and streamer is not None:
        problems.append("a streamer (rows advance by different numbers of tokens; stream one prompt at a time)")
    per_step_outputs = generation_config.output_scores or generation_config.output_logits
    if batch_size > 1 and generation_config.return_dict_in_generate and per_step_outputs:
        problems.append("output_scores / output_logits (rows advance by different numbers of tokens; generate one "
                        "prompt at a time for per-step scores)")
    if problems:
        raise ValueError("generate() with a PosS drafter on a batch or padded prompt does not support: "
                         + "; ".join(problems))
    if padded:
        left_padding(attention_mask)


def _poss_get_candidate_generator(self, generation_config, logits_processor, assistant_model, **unused):
    """The chain-mode candidate generator: the one `_poss_assisted_decoding` prepared for this call."""
    generator = _chain_generator.get()
    if generator is None or generator.drafter.drafter is not assistant_model:
        generator = PosSCandidateGenerator(assistant_model.bind(self), generation_config, logits_processor)
    return generator


def _assistant_in(arguments: dict):
    """The assistant a hooked call names: `assistant_model`, or the one inside `generation_mode_kwargs`."""
    if "assistant_model" in arguments:
        return arguments["assistant_model"]
    return (arguments.get("generation_mode_kwargs") or {}).get("assistant_model")


def _wrap(original, poss_branch):
    """`original` behind a PosS switch, with `original`'s exact signature.

    `generate()` forwards some arguments (`inputs_tensor`) only when the decoding method's signature names them, so
    the wrapper reports the original's signature. Unless the assistant is a PosS drafter, the original is called
    exactly as the wrapper was; otherwise `poss_branch(self, **arguments)` gets every argument by name (bound with the
    original's signature, a `**kwargs` catch-all merged in).
    """
    signature = inspect.signature(original)
    signature_without_self = signature.replace(parameters=list(signature.parameters.values())[1:])

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        try:
            bound = signature_without_self.bind(*args, **kwargs)
        except TypeError:  # a call the original rejects: let it say why
            return original(self, *args, **kwargs)
        arguments = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value
        if not is_poss_drafter(_assistant_in(arguments)):
            return original(self, *args, **kwargs)
        return poss_branch(self, **arguments)

    wrapper.__signature__ = signature
    return wrapper


_POSS_BRANCHES = {
    "_validate_generation_mode": _poss_validate_generation_mode,
    "_assisted_decoding": _poss_assisted_decoding,
    "_get_candidate_generator": _poss_get_candidate_generator,
}


def install_generate_hook() -> None:
    """Wrap the three `GenerationMixin` methods (idempotent). Raises `ImportError` on unsupported transformers."""
    check_transformers_version()
    if _originals:
        return
    for name, poss_branch in _POSS_BRANCHES.items():
        _originals[name] = getattr(GenerationMixin, name)
        setattr(GenerationMixin, name, _wrap(_originals[name], poss_branch))
