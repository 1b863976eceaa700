"""Each drafter kind trains by its reference recipe unless a flag says otherwise: HASS/PosS's for EAGLE-2-style
drafters (fed-back states detached, drafted-token rows), SpecForge's EAGLE-3 for EAGLE-3-style ones (gradients through
the fed-back states, SpecForge's unshifted loss rows, depth 7, no noise, norm clipping, lr 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import DEVICE, tiny_target
from transformers_poss.training import TrainingArguments, UnrolledObjective, build_drafter, unrolled_forward
from transformers_poss.training.cli import arguments_from_namespace, build_train_parser
from transformers_poss.training.objective import prediction_mask


def _args(**overrides) -> TrainingArguments:
    return TrainingArguments(output_dir="x", target="t", data="d", **overrides)


def test_each_kind_takes_its_reference_recipe():
    hass = _args()
    assert (hass.unroll_depth(), hass.noise, hass.lr, hass.beta2, hass.warmup_ratio, hass.lr_schedule) == \
        (3, 0.2, 3e-5, 0.95, 0.03, "linear")
    assert (hass.grad_clip_value, hass.grad_clip_norm, hass.detach_fed_back, hass.loss_rows) == \
        (0.5, None, True, "drafted-token")
    eagle3 = _args(drafter_type="eagle3")
    assert (eagle3.unroll_depth(), eagle3.noise, eagle3.lr, eagle3.beta2, eagle3.warmup_ratio, eagle3.lr_schedule) \
        == (7, 0.0, 1e-4, 0.999, 0.015, "cosine")
    assert (eagle3.grad_clip_value, eagle3.grad_clip_norm, eagle3.detach_fed_back, eagle3.loss_rows) == \
        (None, 0.5, False, "state-token")
    hass.check(), eagle3.check()
    assert hass.recipe_record()["name"] == "hass-poss" and eagle3.recipe_record()["name"] == "specforge-eagle3"
    assert eagle3.recipe_record()["overridden"] == {}


def test_a_flag_overrides_its_setting_only_and_one_clipping_replaces_the_other():
    args = _args(drafter_type="eagle3", lr=2e-4, grad_clip_value=0.3, depth=5, detach_fed_back=True)
    assert (args.lr, args.unroll_depth(), args.detach_fed_back, args.noise) == (2e-4, 5, True, 0.0)
    assert (args.grad_clip_value, args.grad_clip_norm) == (0.3, None)
    record = args.recipe_record()
    assert record["overridden"] == {"lr": 2e-4, "grad_clip_value": 0.3, "depth": 5, "detach_fed_back": True}
    assert record["settings"]["loss_rows"] == "state-token"
    hass = _args(grad_clip_norm=1.0)
    assert (hass.grad_clip_value, hass.grad_clip_norm) == (None, 1.0)


def test_the_command_line_names_each_recipes_default_and_parses_the_new_flags():
    parser = build_train_parser()
    text = parser.format_help()
    assert "eagle 3e-05, eagle3 0.0001" in " ".join(text.split())
    namespace = parser.parse_args(["--output-dir", "x", "--target", "t", "--features", "f", "--drafter-type",
                                   "eagle3", "--detach-fed-back", "--loss-rows", "drafted-token",
                                   "--lr-schedule", "linear"])
    args = arguments_from_namespace(namespace)
    assert (args.detach_fed_back, args.loss_rows, args.lr_schedule, args.lr) == (True, "drafted-token", "linear",
                                                                                  1e-4)
    args.check()


@pytest.mark.parametrize("field, value, message", [
    ("loss_rows", "every", "--loss-rows"), ("lr_schedule", "step", "--lr-schedule"),
    ("warmup_ratio", 1.5, "--warmup-ratio"), ("grad_clip_norm", -1.0, "--grad-clip-norm"),
])
def test_bad_recipe_settings_are_refused_before_any_work(field, value, message):
    with pytest.raises(ValueError, match=message):
        _args(**{field: value}).check()


def test_loss_rows_follow_the_drafted_token_or_the_rows_own_token():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1]])  # L = 7, T = 6 drafter rows
    assert prediction_mask(loss_mask, "drafted-token").tolist() == [[1, 1, 1, 0, 1, 0]]  # x_{t+2}; last row: none
    assert prediction_mask(loss_mask, "state-token").tolist() == [[0, 0, 1, 1, 1, 0]]  # x_t, SpecForge's rows
    with pytest.raises(ValueError, match="loss_rows"):
        prediction_mask(loss_mask, "both")


def _eagle3_case(drafter_type: str = "eagle3"):
    target = tiny_target("llama", num_hidden_layers=8)
    drafter, _ = build_drafter(_args(drafter_type=drafter_type), target)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
    return drafter.bind(target), ids, drafter.target_features(out.hidden_states)


def test_fed_back_states_carry_gradients_only_when_not_detached():
    drafter, ids, features = _eagle3_case()
    for detach in (True, False):
        predictions = unrolled_forward(drafter, ids, features, depth=3, detach_fed_back=detach)
        predictions[0].retain_grad()
        drafter.logits(predictions[2]).logsumexp(-1).sum().backward()  # a loss of the last step alone
        reached = predictions[0].grad is not None and bool(predictions[0].grad.abs().sum() > 0)
        assert reached is (not detach)
        drafter.zero_grad()


def test_detaching_changes_the_gradients_not_the_losses():
    drafter, ids, features = _eagle3_case()
    loss_mask = torch.ones_like(ids)
    outputs, grads = [], []
    for detach in (True, False):
        drafter.zero_grad()
        out = UnrolledObjective(drafter.drafter, drafter.target, depth=4, detach_fed_back=detach, loss_rows="state-token")(
            ids, features, loss_mask)
        out.loss.backward()
        outputs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None]))
    torch.testing.assert_close(outputs[0].loss, outputs[1].loss)
    torch.testing.assert_close(outputs[0].correct, outputs[1].correct)
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cosine < 0.9999  # the later steps' losses now also train what the earlier steps fed them


def test_the_training_record_says_which_recipe_ran(tmp_path):
    from transformers_poss.training import PosSTrainer
    from transformers_poss.training.data import ExampleDataset

    drafter, ids, _ = _eagle3_case()
    examples = [{"input_ids": row.tolist(), "loss_mask": [1] * ids.shape[1]} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), target="t", data="d", drafter_type="eagle3", depth=3,
                             max_steps=2, batch_size=2, mixed_precision="no", progress=False, save_steps=0)
    trainer = PosSTrainer(args, drafter, ExampleDataset(examples))  # `drafter`: bound to its target
    record = trainer.train()
    assert record["recipe"]["name"] == "specforge-eagle3" and record["recipe"]["overridden"] == {"depth": 3}
    assert record["objective"]["detach_fed_back"] is False and record["objective"]["loss_rows"] == "state-token"
    assert record["optimizer"]["grad_clip_norm"] == 0.5 and record["optimizer"]["schedule"] == "cosine"
    saved = json.loads((tmp_path / "training_record.json").read_text())
    assert saved["recipe"]["name"] == "specforge-eagle3"
