"""Uneven position groups (issue 56): `position_groups=[1, 3, 4]` maps draft positions 1 | 2-4 | 5+ to the three
specialists, in drafting, training, saving, export and the card; drafters saved before it load unchanged; bad groups
are refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import FAMILIES, fitted_drafter, prompts, tiny_target
from transformers_poss import PosSConfig, PosSDrafter
from transformers_poss.assets import default_drafter_path
from transformers_poss.training.arguments import TrainingArguments
from transformers_poss.training.objective import check_trainable


def test_groups_map_positions_and_uniform_groups_stay_poss_k():
    target = tiny_target("llama")
    uneven = PosSConfig.from_target_config(target.config, num_specialists=3, position_groups=[1, 3, 4])
    assert [uneven.specialist_for_position(p) for p in range(1, 11)] == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert uneven.describe_groups() == "1 | 2-4 | 5+" and uneven.has_uneven_groups
    uniform = PosSConfig.from_target_config(target.config, num_specialists=3, positions_per_specialist=2)
    assert uniform.group_sizes == [2, 2, 2] and not uniform.has_uneven_groups
    assert [uniform.specialist_for_position(p) for p in range(1, 9)] == [
        min((p - 1) // 2, 2) for p in range(1, 9)]
    assert PosSConfig.from_target_config(target.config, num_specialists=2, position_groups=[2, 2]).group_sizes == [2, 2]


@pytest.mark.parametrize("groups,message", [([1, 2], "2 groups for 3 specialists"), ([1, 0, 2], ">= 1"),
                                            ("1,3,4", "list of integers"), ([1, 2.5, 3], "list of integers")])
def test_bad_groups_are_refused(groups, message):
    with pytest.raises(ValueError, match=message):
        PosSConfig.from_target_config(tiny_target("llama").config, num_specialists=3, position_groups=groups)


def test_training_refuses_groups_that_do_not_cover_the_trained_positions():
    drafter = PosSDrafter.from_target(tiny_target("llama"), num_specialists=3, position_groups=[1, 2, 2])
    with pytest.raises(ValueError, match=r"cover draft positions 1..5; training unrolls 6"):
        check_trainable(drafter, 6)
    check_trainable(drafter, 5)
    with pytest.raises(ValueError, match="depth >= 4"):
        check_trainable(drafter, 3)  # specialist 2 (positions 4+) never trains
    args = TrainingArguments(output_dir="x", target="t", features="f", position_groups="1,3,4", depth=6)
    assert args.specialist_count() == 3 and args.position_group_list() == [1, 3, 4]
    args.check()
    assert TrainingArguments(output_dir="x", target="t", features="f", position_groups="1,3,4").unroll_depth() == 8
    for bad, message in (({"num_specialists": 2}, "3 groups for --num-specialists 2"),
                         ({"depth": 9}, "cover draft positions 1..8"), ({"position_groups": "1,x"}, "integers")):
        fields = {"position_groups": "1,3,4", **bad}
        with pytest.raises(ValueError, match=message):
            TrainingArguments(output_dir="x", target="t", features="f", **fields).check()


@pytest.mark.parametrize("family", FAMILIES)
def test_uneven_groups_draft_losslessly_with_the_specialist_of_each_position(family):
    """fp32 greedy identity with a drafter of groups [1, 2, 3], and each draft level runs its group's specialist."""
    target = tiny_target(family)
    drafter = fitted_drafter(target, num_specialists=3, position_groups=[1, 2, 3], steps=150,
                             tree_depth=5, tree_top_k=3, tree_total_tokens=12)
    ran = []
    original = drafter.run_specialist
    drafter.run_specialist = lambda specialist, *args, **kwargs: (ran.append(specialist), original(
        specialist, *args, **kwargs))[1]
    try:
        for prompt in prompts(count=2):
            reference = target.generate(prompt, do_sample=False, max_new_tokens=24)
            out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                                  return_dict_in_generate=True)
            assert torch.equal(out.sequences, reference), family
    finally:
        del drafter.run_specialist
    assert set(ran) == {0, 1, 2}  # positions 1, 2-3 and 4-5 of a depth-5 tree


def test_groups_round_trip_and_reach_the_card_and_the_vllm_export(tmp_path):
    from transformers_poss.checkpoints.export import export_vllm
    from transformers_poss.hub import render_card

    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, num_specialists=3, position_groups=[1, 3, 4])
    drafter.save_pretrained(tmp_path / "drafter")
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["position_groups"] == [1, 3, 4]
    loaded = PosSDrafter.from_pretrained(tmp_path / "drafter")
    assert loaded.config.group_sizes == [1, 3, 4] and loaded.config.specialist_for_position(5) == 2
    assert "1 | 2-4 | 5+" in str(render_card(loaded))
    target.save_pretrained(tmp_path / "target")
    export_vllm(loaded, tmp_path / "vllm", target=tmp_path / "target")
    poss = json.loads((tmp_path / "vllm" / "config.json").read_text())["poss"]
    assert poss["position_groups"] == [1, 3, 4] and poss["num_specialists"] == 3


def test_drafters_saved_before_groups_load_unchanged():
    for name in ("poss2", "single"):
        folder = default_drafter_path(name)
        assert "position_groups" not in json.loads((folder / "config.json").read_text())
        config = PosSConfig.from_pretrained(folder)
        k, n = config.positions_per_specialist, config.num_specialists
        assert config.position_groups is None and config.group_sizes == [k] * n
        assert [config.specialist_for_position(p) for p in range(1, 9)] == [min((p - 1) // k, n - 1)
                                                                          for p in range(1, 9)]
