"""This library against the PosS authors' own code for their PosS-on-EAGLE-3 drafters (their SpecForge fork in
shrango/PosS `specforge/`, run outside the project on tiny seeded weights saved in their layout,
`LlamaForCausalLMPosSEagle3`, 3 layers; `tests/fixtures/reference/` holds their numbers, not their code).

What their code fixes, and the library reads from the checkpoint: one key/value list shared by the layers (the
context's from layer 0, each later step's from its own layer: `shared_context_kv`) and RoPE base 10000 whatever
config.json says. Their TTT also shifts the attention mask after every step (SafeAILab's EAGLE-3 training mask), which
no drafting does: the library is compared with their TTT run without those four lines (fixture `..._no_shift`) and,
for step 0 (before any shift), with their TTT as it is."""

from __future__ import annotations

import json

import pytest
import torch

from reference_fixtures import (
    library_ttt, load_pair, native_name, reference, reference_step_logits, target_features,
)
from transformers_poss import PosSDrafter
from transformers_poss.generation.drafting import DraftSession, draft_chain


@pytest.fixture(scope="module")
def pair():
    return load_pair("poss_e3")


@pytest.fixture(scope="module")
def ttt(pair):
    target, drafter = pair
    return library_ttt(drafter, target, reference()[0]["sizes"]["ttt_length"])


def test_checkpoint_reads_as_the_authors_trained_it(pair, tmp_path):
    numbers, _ = reference()
    _, drafter = pair
    config = drafter.config
    assert config.num_specialists == numbers["layers"] == 3 and config.positions_per_specialist == 3
    assert config.shared_context_kv
    assert config.layer_config().rope_parameters == {"rope_theta": numbers["rope_base_used"], "rope_type": "default"}
    drafter.save_pretrained(tmp_path)  # a native copy keeps the shared list
    assert json.loads((tmp_path / "config.json").read_text())["shared_context_kv"] is True
    assert PosSDrafter.from_pretrained(tmp_path).config.shared_context_kv


def test_ttt_logits_per_step_match_the_authors(ttt):
    _, tensors = reference()
    logits, _, _ = ttt
    for step, ours in enumerate(logits):
        expected = reference_step_logits(tensors["poss_e3_ttt_no_shift_logits"][step], step)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    # Their TTT as it runs: step 0 is the same; from step 1 the mask shift hides context the chain drafts from.
    as_run = tensors["poss_e3_ttt_logits"]
    torch.testing.assert_close(logits[0], reference_step_logits(as_run[0], 0), rtol=0, atol=1e-5)
    assert all((logits[s] - reference_step_logits(as_run[s], s)).abs().max() > 1e-2 for s in range(1, len(logits)))


def test_ttt_losses_accuracies_and_gradients_match_the_authors(ttt):
    numbers, _ = reference()
    _, output, norms = ttt
    authors = numbers["poss_e3_ttt_no_shift"]
    rows = numbers["poss_e3_trained_in_vocab_rows"]
    assert len(set(rows)) == 1, "the fixture trains the same rows at every step"
    scale = numbers["sizes"]["batch"] * numbers["sizes"]["length"] / rows[0]  # their mean over B * L rows
    torch.testing.assert_close(output.soft_ce.float(), torch.tensor(authors["losses"]) * scale, rtol=0, atol=1e-5)
    assert (output.correct / output.count).tolist() == pytest.approx(authors["accuracies"], abs=1e-6)
    expected = {native_name(name): norm * scale for name, norm in authors["grad_norms"].items()}
    assert set(expected) == set(norms)
    for name, norm in expected.items():
        assert norms[name] == pytest.approx(norm, rel=1e-4), name


@pytest.mark.parametrize("shared", [True, False])
def test_draft_chain_matches_the_authors_only_with_the_shared_list(pair, shared):
    """A greedy chain of 7 draft steps after a 12-token context (their draft model's own pieces, one key/value
    list): the same logits at every level with the shared list; with keys/values of each specialist's own, from
    the first level drafted by specialist 1 (position 4) on they differ."""
    numbers, tensors = reference()
    target, drafter = pair
    sizes, chain_ids = numbers["sizes"], tensors["chain_ids"]
    context = sizes["chain_context"]
    features = target_features(target, drafter, chain_ids)[0]
    drafter.config.shared_context_kv = shared
    try:
        session = DraftSession(drafter)
        session.commit(features[:context], chain_ids[0, 1: context + 1])
        logits = []
        tokens, _ = draft_chain(session, sizes["chain_steps"],
                                lambda level, draft_logits: (logits.append(draft_logits) or draft_logits.argmax(),
                                                             draft_logits))
    finally:
        drafter.config.shared_context_kv = True
    expected = tensors["poss_e3_chain_logits"]
    errors = [float((ours - theirs).abs().max()) for ours, theirs in zip(logits, expected)]
    assert len(errors) == sizes["chain_steps"]
    if shared:
        assert max(errors) <= 1e-5, errors
        assert [int(t) for t in tokens] == numbers["poss_e3_chain"]["tokens"]
    else:
        first_specialist_1 = numbers["poss_e3_chain"]["layers"].index(1)
        assert max(errors[:first_specialist_1]) <= 1e-5 and min(errors[first_specialist_1:]) > 1e-2, errors
