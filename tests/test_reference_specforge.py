"""This library's EAGLE-3 training objective against SpecForge 0.2.0's EAGLE-3 TTT (`tests/fixtures/reference/`:
SpecForge ran on the CPU in fp32 on a tiny seeded target and a SpecForge-layout draft checkpoint; its numbers are
recorded there, its code is not imported): the same weights read with `PosSDrafter.from_pretrained`, the same inputs,
7 unroll steps. Per-step draft logits and losses agree within 1e-5, accuracies exactly, gradient norms within 1e-4
relative.

SpecForge averages a step's loss over all `B * L` rows, this library over the rows it trains (loss mask 1, target
token in the draft vocabulary); the fixture's loss mask trains the same rows at every step (a 6-token prompt), so
the two differ by one recorded factor, `B * L / rows`, for each step's loss and for the gradients."""

from __future__ import annotations

import pytest
import torch

from transformers_poss import PosSEagle3Config
from reference_fixtures import library_ttt, load_pair, native_name, reference, reference_step_logits


@pytest.fixture(scope="module")
def run():
    numbers, tensors = reference()
    target, drafter = load_pair("eagle3_specforge")
    return numbers, tensors, drafter, library_ttt(drafter, target, numbers["sizes"]["ttt_length"])


def test_checkpoint_reads_as_specforge_built_it(run):
    numbers, _, drafter, _ = run
    config = drafter.config
    assert isinstance(config, PosSEagle3Config) and config.num_specialists == 1 and not config.shared_context_kv
    assert config.feature_layers == numbers["sizes"]["fused_states"]
    assert config.layer_config().rope_parameters["rope_theta"] == 50000.0  # SpecForge 0.2.0 honours rope_theta


def test_draft_logits_per_step_match_specforge(run):
    numbers, tensors, _, (logits, _, _) = run
    reference_logits = tensors["specforge_eagle3_logits"]
    assert len(logits) == reference_logits.shape[0] == numbers["sizes"]["ttt_length"]
    for step, ours in enumerate(logits):
        torch.testing.assert_close(ours, reference_step_logits(reference_logits[step], step), rtol=0, atol=1e-5)


def test_losses_and_accuracies_per_step_match_specforge(run):
    numbers, _, _, (_, output, _) = run
    specforge = numbers["specforge_eagle3"]
    rows = specforge["trained_in_vocab_rows"]
    expected = torch.tensor([loss * specforge["loss_denominator"] / n for loss, n in zip(specforge["losses"], rows)])
    torch.testing.assert_close(output.soft_ce.float(), expected, rtol=0, atol=1e-5)
    assert output.count.tolist() == specforge["loss_mask_rows"]
    assert output.correct.tolist() == specforge["correct"]
    scale = specforge["loss_denominator"] / rows[0]
    assert float(output.loss.detach()) == pytest.approx(specforge["total_loss"] * scale, rel=1e-6, abs=1e-5)


def test_gradient_norms_match_specforge(run):
    numbers, _, _, (_, _, norms) = run
    specforge = numbers["specforge_eagle3"]
    rows = specforge["trained_in_vocab_rows"]
    assert len(set(rows)) == 1, "the fixture trains the same rows at every step"
    scale = specforge["loss_denominator"] / rows[0]
    expected = {native_name(name): norm * scale for name, norm in specforge["grad_norms"].items()}
    assert set(expected) == set(norms)
    for name, norm in expected.items():
        assert norms[name] == pytest.approx(norm, rel=1e-4), name
