"""The generate() hook is invisible to transformers' own assisted generation and prompt lookup.

Every case runs `generate` twice on freshly built tiny random models: once through the hook and once with
transformers' original methods restored (`hook._originals`), and the outputs (sequences and scores) must be equal.
The assistant (and its encoder) must also be given the same inputs in both runs, and greedy runs must equal plain
greedy decoding. Sampling runs use a fixed seed.

The `t5-same`/`t5-smaller` and `whisper-same`/`whisper-smaller` cases are transformers' own T5 and Whisper
`test_assisted_decoding_matches_greedy_search_1_same`/`_0_random` and `test_assisted_decoding_sample`, which failed
with this library imported while the hook hid `inputs_tensor` from `generate()`.
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_target
from tiny_tokenizer import char_tokenizer
from transformers import (
    BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, T5Config,
    T5ForConditionalGeneration, WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration,
)
from transformers.generation.utils import GenerationMixin

from transformers_poss.generation import hook

MAX_NEW_TOKENS = 12


@contextlib.contextmanager
def originals_restored():
    """transformers' own `GenerationMixin` methods in place of the hook's wrappers, for the `with` block."""
    wrappers = {name: getattr(GenerationMixin, name) for name in hook._originals}
    for name, original in hook._originals.items():
        setattr(GenerationMixin, name, original)
    try:
        yield
    finally:
        for name, wrapper in wrappers.items():
            setattr(GenerationMixin, name, wrapper)


def _no_special_tokens(model):
    """`model` generating exactly `MAX_NEW_TOKENS` (no EOS stop, no padding), in eval mode."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def _llama(seed: int = 0, layers: int = 2, hidden: int = 64, vocab_size: int = 96):
    """A tiny random Llama (the suite's `tiny_target`), `layers` deep and `hidden` wide."""
    return tiny_target("llama", vocab_size=vocab_size, seed=seed, num_hidden_layers=layers, hidden_size=hidden,
                       intermediate_size=2 * hidden)


def _gpt2(seed: int = 0, layers: int = 2, vocab_size: int = 96):
    """A tiny random GPT-2 (learned positions, fused QKV: another decoder-only layout than Llama)."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=layers, n_head=4, n_positions=128,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return _no_special_tokens(GPT2LMHeadModel(config))


def _t5(seed: int = 0, layers: int = 2):
    """A tiny T5 whose config has no `bos_token_id` (as in transformers' T5 tests)."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=layers, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return _no_special_tokens(T5ForConditionalGeneration(config))


def _bart(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    config = BartConfig(vocab_size=99, d_model=16, encoder_layers=layers, decoder_layers=layers,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=8, decoder_ffn_dim=8,
                        max_position_embeddings=64, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                        decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None)
    return _no_special_tokens(BartForConditionalGeneration(config))


def _whisper_config(decoder_layers: int = 2) -> WhisperConfig:
    """Input features are `[batch, 80, 60]` (twice `max_source_positions`)."""
    return WhisperConfig(vocab_size=200, d_model=16, encoder_layers=2, decoder_layers=decoder_layers,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=16,
                         decoder_ffn_dim=16, num_mel_bins=80, max_source_positions=30, max_target_positions=40,
                         bos_token_id=98, eos_token_id=98, pad_token_id=0, decoder_start_token_id=85,
                         suppress_tokens=None, begin_suppress_tokens=None)


def _whisper(seed: int = 0, decoder_layers: int = 2):
    torch.manual_seed(seed)
    return _no_special_tokens(WhisperForConditionalGeneration(_whisper_config(decoder_layers)))


def _whisper_decoder(seed: int = 1):
    """A one-layer decoder-only Whisper (the distil-whisper assistant shape): it reads the target's encoder outputs."""
    torch.manual_seed(seed)
    return _no_special_tokens(WhisperForCausalLM(_whisper_config(decoder_layers=1)))


class _IdOrderedVocabTokenizer(PreTrainedTokenizerFast):
    """`get_vocab()` in id order.

    transformers' sampling path for different tokenizers lines the pruned assistant LM-head rows up with the
    assistant vocabulary's iteration order, which the Rust backend leaves random: the output would change from run to
    run, hook or not.
    """

    def get_vocab(self) -> dict[str, int]:
        return dict(sorted(super().get_vocab().items(), key=lambda token_and_id: token_and_id[1]))


def _permuted_char_tokenizer() -> PreTrainedTokenizerFast:
    """Another vocabulary (89 tokens): the tiny targets' characters reversed, without digits, with three of its own.

    transformers' sampling path for different tokenizers needs an assistant vocabulary that is not a subset of the
    target's (with a subset it fails before the first candidate, hook or not).
    """
    from tokenizers import Tokenizer, decoders, models

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(126, 31, -1) if chr(c) not in "`~^0123456789"] + ["\n", "ä", "ö", "ü"]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    return _IdOrderedVocabTokenizer(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")


def _text_ids(vocab_size: int, length: int = 8) -> dict:
    return {"input_ids": torch.randint(3, vocab_size, (1, length), generator=torch.Generator().manual_seed(1))}


def _repeating_ids() -> dict:
    """A prompt whose n-grams recur, so prompt lookup finds continuations to propose."""
    return {"input_ids": torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])}


def _audio_features() -> dict:
    return {"input_features": torch.randn(1, 80, 60, generator=torch.Generator().manual_seed(1))}


def _case_same(build, inputs):
    model = build()
    return model, inputs, {"assistant_model": model}


# Each case builds fresh models: (target, generate inputs, assistant kwargs). Assistants keep state across calls
# (the heuristic number of assistant tokens, a pruned LM head), so the two runs must not share them.
CASES = {
    "llama-same": lambda: _case_same(_llama, _text_ids(96)),
    "llama-smaller": lambda: (_llama(), _text_ids(96), {"assistant_model": _llama(seed=1, layers=1, hidden=32)}),
    "llama-prompt-lookup": lambda: (_llama(), _repeating_ids(), {"prompt_lookup_num_tokens": 3}),
    "gpt2-same": lambda: _case_same(_gpt2, _text_ids(96)),
    "gpt2-smaller": lambda: (_gpt2(), _text_ids(96), {"assistant_model": _gpt2(seed=1, layers=1)}),
    "llama-gpt2-other-tokenizer": lambda: (
        _llama(), _text_ids(96),
        {"assistant_model": _gpt2(seed=1, vocab_size=89), "tokenizer": char_tokenizer(),
         "assistant_tokenizer": _permuted_char_tokenizer()},
    ),
    "t5-same": lambda: _case_same(_t5, _text_ids(99)),
    "t5-smaller": lambda: (_t5(), _text_ids(99), {"assistant_model": _t5(seed=1, layers=1)}),
    "t5-prompt-lookup": lambda: (_t5(), _repeating_ids(), {"prompt_lookup_num_tokens": 3}),
    "bart-same": lambda: _case_same(_bart, _text_ids(99)),
    "bart-smaller": lambda: (_bart(), _text_ids(99), {"assistant_model": _bart(seed=1, layers=1)}),
    "whisper-same": lambda: _case_same(_whisper, _audio_features()),
    "whisper-smaller": lambda: (_whisper(), _audio_features(), {"assistant_model": _whisper(seed=1, decoder_layers=1)}),
    "whisper-decoder-only-assistant": lambda: (_whisper(), _audio_features(), {"assistant_model": _whisper_decoder()}),
}


def _generate(case: str, do_sample: bool, assisted: bool = True):
    """Fresh models of `case`, greedy or seeded sampling: the output (with scores) and, for each forward of the
    assistant (and of its encoder), the shapes of the tensors it was given."""
    model, inputs, assistant_kwargs = CASES[case]()
    assistant_forwards = []
    assistant = assistant_kwargs.get("assistant_model")
    if assistant is not None:
        modules = [assistant, assistant.get_encoder()] if assistant.config.is_encoder_decoder else [assistant]
        for module in modules:
            module.register_forward_pre_hook(
                lambda module, args, kwargs: assistant_forwards.append(_tensor_shapes(module, args, kwargs)),
                with_kwargs=True,
            )
    torch.manual_seed(0)
    output = model.generate(**inputs, **(assistant_kwargs if assisted else {}), do_sample=do_sample,
                            max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, output_scores=True)
    return output, assistant_forwards


def _tensor_shapes(module, args, kwargs) -> tuple:
    """`(module class, shapes of the positional tensors, {name: shape} of the keyword tensors)`."""
    return (
        type(module).__name__,
        [tuple(value.shape) for value in args if torch.is_tensor(value)],
        {name: tuple(value.shape) for name, value in kwargs.items() if torch.is_tensor(value)},
    )


def _assert_same_output(hooked, original):
    assert torch.equal(hooked.sequences, original.sequences)
    assert len(hooked.scores) == len(original.scores)
    for hooked_step, original_step in zip(hooked.scores, original.scores):
        assert torch.equal(hooked_step, original_step)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("case", list(CASES))
def test_assisted_generation_unchanged_by_the_hook(case, do_sample):
    hooked, hooked_assistant_forwards = _generate(case, do_sample)
    with originals_restored():
        original, original_assistant_forwards = _generate(case, do_sample)
    _assert_same_output(hooked, original)
    # A tiny random assistant's drafts are rarely accepted, so an assistant fed the wrong inputs (a 1-token encoder
    # prompt) can still give the same output: compare what it was given too.
    assert hooked_assistant_forwards == original_assistant_forwards
    assert hooked.sequences.shape[-1] > MAX_NEW_TOKENS - 1
    if not do_sample:
        plain, _ = _generate(case, do_sample, assisted=False)
        assert torch.equal(hooked.sequences, plain.sequences)


@pytest.mark.parametrize("name", sorted(hook._POSS_BRANCHES))
def test_wrappers_keep_the_original_signatures(name):
    wrapper = getattr(GenerationMixin, name)
    assert wrapper is not hook._originals[name]
    assert inspect.signature(wrapper) == inspect.signature(hook._originals[name])


def test_wrapper_passes_other_calls_through_and_hands_poss_calls_every_argument_by_name():
    def original(self, input_ids, generation_config=None, *, assistant_model=None, **model_kwargs):
        return "original", self, input_ids, generation_config, assistant_model, model_kwargs

    wrapper = hook._wrap(original, poss_branch=lambda self, **arguments: ("poss", self, arguments))
    target, other_assistant, drafter = object(), _gpt2(), SimpleNamespace(is_poss_drafter=True)
    assert inspect.signature(wrapper) == inspect.signature(original)
    assert wrapper(target, 1, 2, assistant_model=other_assistant, cache=3) == (
        "original", target, 1, 2, other_assistant, {"cache": 3})
    with pytest.raises(TypeError, match="original.. missing 1 required positional argument: 'input_ids'"):
        wrapper(target, assistant_model=drafter)
    assert wrapper(target, 1, 2, assistant_model=drafter, cache=3) == (
        "poss", target, {"input_ids": 1, "generation_config": 2, "assistant_model": drafter, "cache": 3})


def _assisted_decoding_without_inputs_tensor(self, input_ids, logits_processor, stopping_criteria,
                                              generation_config, synced_gpus=False, streamer=None,
                                              assistant_model=None, assistant_tokenizer=None, tokenizer=None,
                                              **model_kwargs):
    """`_assisted_decoding` as a future transformers might change it."""


def _assisted_decoding_without_model_kwargs(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                            synced_gpus=False, streamer=None, inputs_tensor=None,
                                            assistant_model=None, assistant_tokenizer=None, tokenizer=None):
    """`_assisted_decoding` as a future transformers might change it."""


@pytest.mark.parametrize(("changed", "missing"), [
    (_assisted_decoding_without_inputs_tensor, "inputs_tensor"),
    (_assisted_decoding_without_model_kwargs, r"\*\*"),
])
def test_import_check_refuses_a_changed_signature(monkeypatch, changed, missing):
    monkeypatch.setitem(hook._originals, "_assisted_decoding", changed)
    with pytest.raises(ImportError, match=rf"_assisted_decoding.*no longer takes {missing}"):
        hook.check_transformers_version()


def _sample_without_streamer(self, input_ids, logits_processor, stopping_criteria, generation_config,
                             synced_gpus=False, **model_kwargs):
    """`_sample` as a future transformers might change it."""


def test_import_check_refuses_a_changed_plain_loop(monkeypatch):
    """The plain fallback calls `_sample` (above a device kind's `max_batch_size`): a changed one is caught at import."""
    from transformers.generation.utils import GenerationMixin

    monkeypatch.setattr(GenerationMixin, "_sample", _sample_without_streamer)
    with pytest.raises(ImportError, match=r"_sample, which transformers-poss calls.*no longer takes streamer"):
        hook.check_transformers_version()
