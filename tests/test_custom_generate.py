"""`target.generate(**inputs, custom_generate=DRAFTER_FOLDER, trust_remote_code=True)`: a saved drafter folder's
`custom_generate/generate.py` drafts with the drafter stored beside it (an `assistant_model=` passed with it wins), with
the output of `assistant_model=drafter` (fp32) and its `speculative_stats`."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from tiny_models import prompts
from transformers.dynamic_module_utils import check_python_requirements

from transformers_poss import PosSDrafter
from transformers_poss.assets import default_drafter_path
from transformers_poss.checkpoints.custom_generate import requirement
from transformers_poss.generation import speculative_generate

MAX_NEW_TOKENS = 16


@pytest.fixture
def saved(fitted_pairs, tmp_path):
    """(target, drafter, folder): the fitted tiny pair, the drafter saved in `folder`."""
    target, drafter = fitted_pairs("llama")
    drafter.save_pretrained(tmp_path / "drafter")
    return target, drafter, str(tmp_path / "drafter")


def _inputs(prompt):
    return {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}


def test_save_pretrained_writes_the_custom_generate_files(saved):
    _, _, folder = saved
    code = open(f"{folder}/custom_generate/generate.py").read()
    assert "from transformers_poss.generation import speculative_generate" in code
    assert "def generate(model, assistant_model=None, **generate_kwargs)" in code
    line = open(f"{folder}/custom_generate/requirements.txt").read().strip()
    assert line == requirement(importlib.metadata.version("transformers-poss")) == "transformers-poss>=0.1,<0.2"
    check_python_requirements(folder, requirements_file="custom_generate/requirements.txt")  # the installed one fits


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_custom_generate_drafts_with_the_stored_drafter_as_assistant_model_does(saved, mode):
    target, drafter, folder = saved
    drafter.generation_config.draft_mode = mode
    drafter.save_pretrained(folder)
    for prompt in prompts(count=2):
        expected = target.generate(**_inputs(prompt), assistant_model=drafter, max_new_tokens=MAX_NEW_TOKENS,
                                   do_sample=False, return_dict_in_generate=True)
        out = target.generate(**_inputs(prompt), custom_generate=folder, trust_remote_code=True,
                              max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected.sequences)
        assert torch.equal(out.sequences, target.generate(**_inputs(prompt), max_new_tokens=MAX_NEW_TOKENS,
                                                          do_sample=False))
        stats = out.speculative_stats
        assert stats.draft_mode == mode and stats.num_rounds > 0
        assert stats.acceptance_lengths == expected.speculative_stats.acceptance_lengths
    plain_tensor = target.generate(prompt, custom_generate=folder, trust_remote_code=True,
                                   max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert torch.equal(plain_tensor, expected.sequences)  # without return_dict_in_generate: the sequences


def test_an_assistant_model_passed_with_custom_generate_wins(saved):
    target, drafter, folder = saved
    chain = drafter.with_generation_config(draft_mode="chain")  # the stored drafter drafts trees
    prompt = prompts(count=1)[0]
    out = target.generate(**_inputs(prompt), custom_generate=folder, trust_remote_code=True, assistant_model=chain,
                          max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    expected = target.generate(**_inputs(prompt), assistant_model=chain, max_new_tokens=MAX_NEW_TOKENS,
                               do_sample=False, return_dict_in_generate=True)
    assert out.speculative_stats.draft_mode == "chain"
    assert out.speculative_stats.acceptance_lengths == expected.speculative_stats.acceptance_lengths
    assert torch.equal(out.sequences, expected.sequences)


def test_custom_generate_needs_trust_remote_code(saved):
    target, _, folder = saved
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(prompts(count=1)[0], custom_generate=folder, trust_remote_code=False, max_new_tokens=2)


def test_speculative_generate_takes_a_drafter_or_its_folder_and_needs_one(saved):
    target, drafter, folder = saved
    prompt = prompts(count=1)[0]
    expected = target.generate(prompt, assistant_model=drafter, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert torch.equal(speculative_generate(target, drafter, inputs=prompt, max_new_tokens=MAX_NEW_TOKENS), expected)
    assert torch.equal(speculative_generate(target, folder, inputs=prompt, max_new_tokens=MAX_NEW_TOKENS), expected)
    with pytest.raises(ValueError, match="needs a drafter"):
        speculative_generate(target, inputs=prompt, max_new_tokens=2)
    with pytest.raises(ValueError, match="PosS drafter"):
        speculative_generate(target, target, inputs=prompt, max_new_tokens=2)


def test_requirement_names_the_release_series():
    assert requirement("0.1.0") == "transformers-poss>=0.1,<0.2"
    assert requirement("0.12.3") == "transformers-poss>=0.12,<0.13"
    assert requirement("1.2.0") == "transformers-poss>=1.2,<2"


@pytest.mark.parametrize("name", ["poss2", "single"])
def test_shipped_drafters_carry_the_custom_generate_files(name, tmp_path):
    folder = default_drafter_path(name)
    assert (folder / "custom_generate" / "requirements.txt").is_file()
    shipped = (folder / "custom_generate" / "generate.py").read_text()
    drafter = PosSDrafter.from_pretrained(folder)
    drafter.save_pretrained(tmp_path)  # what save_pretrained writes today: the shipped files are not stale
    assert shipped == (tmp_path / "custom_generate" / "generate.py").read_text()
    assert (folder / "custom_generate" / "requirements.txt").read_text() == \
        (tmp_path / "custom_generate" / "requirements.txt").read_text()
