"""The real default target (SmolLM2-135M-Instruct, float32): greedy speculative outputs are token-identical.

Slow (real model; the first run downloads and converts it, about a minute). The drafter is fitted inside the test on
the target's own greedy answers (teacher forcing, a few dozen steps); the shipped drafter is tested too (a missing one
fails, as a packaging regression should).
"""

from __future__ import annotations

import pytest
import torch
from drafter_fitting import fit_drafter_to_sequences

from transformers_poss import PosSDrafter
from transformers_poss.assets import (
    DEFAULT_TARGET_NAME, END_OF_TURN_TOKEN, load_default_drafter, load_default_target,
)
from transformers_poss.metrics import mean_acceptance_length

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]
MAX_NEW_TOKENS = 32
# Drafting at every batch size: these tests check lossless drafting, whatever the shipped entry of this machine's kind
# says pays (an entry with max_batch_size 0 decodes plainly).
BUDGET = dict(tree_depth=4, tree_top_k=4, tree_total_tokens=16, speculation="always")


@pytest.fixture(scope="module")
def target_and_tokenizer():
    return load_default_target(dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts_and_references(target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        for chat in CHATS
    ]
    with torch.no_grad():
        references = [target.generate(p, max_new_tokens=MAX_NEW_TOKENS, do_sample=False) for p in prompts]
    return prompts, references


@pytest.fixture(scope="module")
def fitted(target_and_tokenizer, prompts_and_references):
    target, _ = target_and_tokenizer
    prompts, references = prompts_and_references
    torch.manual_seed(0)
    drafter = PosSDrafter.from_target(target, num_specialists=3, positions_per_specialist=2, **BUDGET)
    return fit_drafter_to_sequences(target, drafter, references, [p.shape[1] for p in prompts], steps=60, lr=2e-3)


def test_default_target_is_the_chat_model(target_and_tokenizer, prompts_and_references):
    target, tokenizer = target_and_tokenizer
    assert target.config.model_type == "llama" and target.config.vocab_size == 49152
    assert target.config._name_or_path == DEFAULT_TARGET_NAME and target.dtype == torch.float32
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    eos = target.generation_config.eos_token_id
    assert end in (eos if isinstance(eos, list) else [eos])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    prompts, references = prompts_and_references
    # the short answer stops at the end-of-turn token, well before the token limit
    short = references[0][0, prompts[0].shape[1]:]
    assert short[-1].item() == end and short.shape[0] < MAX_NEW_TOKENS
    assert "Paris" in tokenizer.decode(short)


def _check_identity(target, drafter, mode, prompts, references) -> float:
    drafter.generation_config.draft_mode = mode
    lengths = []
    for prompt, reference in zip(prompts, references):
        with torch.no_grad():
            out = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=drafter,
                                  return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference), f"{mode}: speculative output differs from plain greedy"
        lengths += out.speculative_stats.acceptance_lengths
    return mean_acceptance_length(lengths)


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_fitted_drafter_is_lossless_and_accepts(target_and_tokenizer, prompts_and_references, fitted, mode):
    target, _ = target_and_tokenizer
    tau = _check_identity(target, fitted, mode, *prompts_and_references)
    assert tau > 1.0


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_shipped_drafter_is_lossless_and_accepts(target_and_tokenizer, prompts_and_references, mode):
    target, _ = target_and_tokenizer
    drafter = load_default_drafter("poss2", target).with_generation_config(**BUDGET)
    tau = _check_identity(target, drafter, mode, *prompts_and_references)
    assert tau > 1.2


def test_shipped_drafter_on_a_padded_batch_is_identical_row_by_row(target_and_tokenizer):
    """A left-padded batch of 4 chat prompts (fp32, tree mode, with the lookup branch): every row equals plain
    batched `generate`'s."""
    target, tokenizer = target_and_tokenizer
    chats = CHATS + ["List three uses of a paperclip.", "Explain what a hash table is to a child, briefly."]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                           tokenize=False) for chat in chats]
    batch = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    assert (batch["attention_mask"] == 0).any()  # the prompts really are padded
    drafter = load_default_drafter("poss2", target).with_generation_config(**BUDGET)
    with torch.no_grad():
        reference = target.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out = target.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=drafter,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert len(out.row_stats) == 4
    assert out.speculative_stats.mean_acceptance_length > 1.2


def test_shipped_drafter_drafts_with_what_the_user_sets(target_and_tokenizer, prompts_and_references):
    """Issue 58 on the shipped default (it carries tuned entries per device kind): a depth set by attribute is the
    depth that drafts, whatever this machine's kind; the other values come from the kind's entry or the default."""
    from transformers_poss.devices import device_kind

    target, _ = target_and_tokenizer
    prompts, references = prompts_and_references
    drafter = load_default_drafter("poss2", target)
    kind = device_kind(target.device, target.dtype)
    drafter.generation_config.tree_depth = 3  # no shipped entry has depth 3
    out = target.generate(prompts[0], max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    budget = out.speculative_stats.budget
    assert out.speculative_stats.tree_depth == 3 and budget.sources["tree_depth"] == "set by the user"
    assert budget.device_kind == kind and torch.equal(out.sequences, references[0])
    entry = drafter.generation_config.device_budgets.get(kind, {})
    default = drafter.generation_config.default_budget
    assert budget.settings["tree_top_k"] == entry.get("tree_top_k", default["tree_top_k"])
    with pytest.raises(ValueError, match=r"target\.generate\(\.\.\., top_k="):
        drafter.with_generation_config(top_k=4)
