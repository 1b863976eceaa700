"""`pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter)` drafts with a PosS drafter and
returns what the same pipeline returns without it (fp32, greedy): chat and plain text, `return_full_text`, sampling,
a streamer, batches (left-padded by the pipeline), a drafter named by its folder; a drafter for another target is
refused when the pipeline is built, with `generate`'s error."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_target
from tiny_tokenizer import char_tokenizer
from transformers import TextStreamer, pipeline

from transformers_poss import PosSConfig, PosSDrafter

CHAT = [{"role": "user", "content": "Name a red fruit."}]
TEXTS = ["Once upon a time", "A longer prompt than the first one", "Hi"]
MAX_NEW_TOKENS = 16


@pytest.fixture
def setup(fitted_pairs):
    """(target, drafter, tokenizer, counter): `counter` holds the number of drafter forwards so far."""
    target, drafter = fitted_pairs("llama")
    tokenizer = char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # transformers' pipelines batch only with a pad token
    counter = [0]
    handle = drafter.fc.register_forward_hook(lambda *args: counter.__setitem__(0, counter[0] + 1))
    yield target, drafter, tokenizer, counter
    handle.remove()


def _both(target, drafter, tokenizer, inputs, **kwargs):
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, **kwargs}
    return plain(inputs, **kwargs), speculative(inputs, **kwargs)


@pytest.mark.parametrize("inputs", [CHAT, TEXTS[0]], ids=["chat", "text"])
@pytest.mark.parametrize("return_full_text", [True, False])
def test_pipeline_drafts_and_answers_as_without_the_drafter(setup, inputs, return_full_text):
    target, drafter, tokenizer, counter = setup
    plain, speculative = _both(target, drafter, tokenizer, inputs, return_full_text=return_full_text)
    assert speculative == plain
    assert counter[0] > 0  # the drafter drafted
    answer = speculative[0]["generated_text"]
    if isinstance(inputs, list):  # chat: the conversation with the answer appended, or the answer alone
        assert (answer[-1]["role"] == "assistant") if return_full_text else isinstance(answer, str)
    else:
        assert answer.startswith(inputs) == return_full_text


def test_pipeline_batches_left_padded_prompts_through_the_drafter(setup):
    target, drafter, tokenizer, counter = setup
    plain, speculative = _both(target, drafter, tokenizer, TEXTS, batch_size=3)
    assert speculative == plain and counter[0] > 0
    assert tokenizer.padding_side == "left"  # set by the pipeline for batches


def test_pipeline_batch_above_max_batch_size_is_decoded_plainly(setup):
    target, drafter, tokenizer, counter = setup
    capped = drafter.with_generation_config(max_batch_size=1)
    plain, speculative = _both(target, capped, tokenizer, TEXTS, batch_size=3)
    assert speculative == plain and counter[0] == 0


def test_pipeline_sampling_with_top_k_1_answers_as_greedy(setup):
    """Sampling runs the drafter's sampling path; with top_k=1 its distribution is the greedy token's."""
    target, drafter, tokenizer, counter = setup
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)(TEXTS, max_new_tokens=MAX_NEW_TOKENS,
                                                                           do_sample=False)
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    sampled = speculative(TEXTS, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, top_k=1, batch_size=2)
    assert sampled == plain and counter[0] > 0


class _Collect(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text


def test_pipeline_streams_the_answer(setup):
    target, drafter, tokenizer, counter = setup
    streamed = {}
    for name, assistant in (("plain", None), ("speculative", drafter)):
        extra = {} if assistant is None else {"assistant_model": assistant}
        streamer = _Collect(tokenizer)
        answer = pipeline("text-generation", model=target, tokenizer=tokenizer, **extra)(
            TEXTS[0], max_new_tokens=MAX_NEW_TOKENS, do_sample=False, streamer=streamer, return_full_text=False)
        streamed[name] = (streamer.text, answer[0]["generated_text"])
    assert streamed["speculative"] == streamed["plain"] and counter[0] > 0
    assert streamed["plain"][0] == streamed["plain"][1]  # the streamer received the whole answer


def test_pipeline_loads_a_drafter_folder_named_by_a_string(setup, tmp_path):
    target, drafter, tokenizer, _ = setup
    drafter.save_pretrained(tmp_path / "drafter")
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer,
                           assistant_model=str(tmp_path / "drafter"))
    assert isinstance(speculative.assistant_model, PosSDrafter) and speculative.assistant_tokenizer is None
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
    assert speculative(TEXTS[1], **kwargs) == plain(TEXTS[1], **kwargs)


@pytest.mark.parametrize("other", [dict(vocab_size=128), dict(hidden_size=32, intermediate_size=64)],
                         ids=["vocabulary", "hidden-size"])
def test_pipeline_refuses_a_drafter_for_another_target_as_generate_does(setup, other):
    target, _, tokenizer, _ = setup
    foreign = PosSDrafter.from_target(tiny_target("llama", **other))
    with pytest.raises(ValueError) as from_generate:
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=foreign, max_new_tokens=2)
    with pytest.raises(ValueError) as from_pipeline:
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=foreign)
    assert str(from_pipeline.value) == str(from_generate.value)
    assert "This PosS drafter was built for a target with" in str(from_pipeline.value)


def test_drafter_config_reports_its_targets_special_tokens(tmp_path):
    target = tiny_target("llama", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    drafter = PosSDrafter.from_target(target)
    drafter.save_pretrained(tmp_path)
    for config in (drafter.config, PosSConfig.from_pretrained(tmp_path)):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
        assert config.vocab_size == target.config.vocab_size
    unrecorded = {k: v for k, v in drafter.config.target_config.items() if not k.endswith("_token_id")}
    assert PosSConfig(target_config=unrecorded).eos_token_id is None
    # the pipeline sees the same tokenizer: no assistant tokenizer needed, and the drafter drafts
    speculative = pipeline("text-generation", model=target, tokenizer=char_tokenizer(), assistant_model=drafter)
    assert speculative.assistant_tokenizer is None
    assert isinstance(speculative("Hi", max_new_tokens=4, do_sample=False)[0]["generated_text"], str)


def test_other_assistants_pass_through_the_pipeline_unchanged(setup):
    """A plain transformers assistant (another tiny Llama): transformers' own assisted generation, greedy output."""
    target, _, tokenizer, counter = setup
    assistant = tiny_target("llama", seed=3)
    plain, assisted = _both(target, assistant, tokenizer, TEXTS[0])
    assert assisted == plain and counter[0] == 0


@pytest.mark.slow
def test_pipeline_on_the_default_target_with_the_shipped_drafter():
    from transformers_poss.assets import load_default_drafter, load_default_target

    target, tokenizer = load_default_target(dtype=torch.float32)
    drafter = load_default_drafter("poss2", target=target).with_generation_config(speculation="always")
    chats = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
             [{"role": "user", "content": "Write a haiku about the sea."}]]
    kwargs = {"max_new_tokens": 24, "do_sample": False}
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)(chats, batch_size=2, **kwargs)
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    assert speculative(chats, batch_size=2, **kwargs) == plain
    assert speculative(chats[0], **kwargs) == plain[0]
    assert "Paris" in plain[0][0]["generated_text"][-1]["content"]

