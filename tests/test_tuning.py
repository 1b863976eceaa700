"""`poss tune`: the replay of recorded rounds, the ranking, and the command's errors."""

import copy

import pytest
import torch

from tiny_models import prompts
from transformers_poss.cli import main as poss_main
from transformers_poss.generation.decoding import observe_rounds
from transformers_poss.generation.drafting import DraftSession, draft_tree, level_rank
from transformers_poss.tuning import (drafted_depth, format_costs, format_table, replay_accepted, stopping_ranks,
                                     subtree_candidates, tune)


def _traced_generate(target, drafter, prompt, depth, top_k, total_tokens, max_new_tokens=24):
    """The call's statistics and its rounds as `poss tune` records them."""
    view = drafter.with_generation_config(draft_mode="tree", tree_depth=depth, tree_top_k=top_k,
                                          tree_total_tokens=total_tokens)
    traces = []
    with observe_rounds(traces.append):
        out = target.generate(prompt, assistant_model=view, max_new_tokens=max_new_tokens, do_sample=False,
                              return_dict_in_generate=True)
    return out.speculative_stats, traces


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_replay_at_the_calibrated_budget_reproduces_every_round(fitted_pairs, family):
    target, drafter = fitted_pairs(family)
    lengths, replayed = [], []
    for prompt in prompts(target.config.vocab_size, 3):
        stats, traces = _traced_generate(target, drafter, prompt, depth=4, top_k=3, total_tokens=12)
        assert len(traces) == stats.num_rounds
        lengths += stats.acceptance_lengths
        replayed += [replay_accepted(trace, 4, 12) for trace in traces]
    assert replayed == lengths
    assert 0 in lengths and max(lengths) >= 2  # rounds with nothing and with several drafts accepted


def test_subtree_of_recorded_candidates_is_the_tree_drafted_with_the_smaller_budget(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    ids = prompts(target.config.vocab_size, 1)[0]
    with torch.no_grad():
        out = target(ids[:, :-1], output_hidden_states=-1)
    session = DraftSession(drafter.bind(target))
    session.commit(out.hidden_states[-1][0], ids[0, 1:])
    big = draft_tree(session, ids[0, -1], depth=4, top_k=3, total_tokens=30)
    session.end_round()
    assert int(big.candidates.depths.max()) == 4  # a budget as large as the full tree never stops early
    ranks, stopped_early = stopping_ranks(big.candidates), 0
    for depth, total in [(1, 3), (2, 5), (3, 8), (4, 12), (4, 30), (2, 30), (4, 2), (4, 3), (4, 4), (4, 6)]:
        small = draft_tree(session, ids[0, -1], depth=depth, top_k=3, total_tokens=total)
        session.end_round()
        chosen = subtree_candidates(big.candidates, depth, total)
        assert torch.equal(big.candidates.tokens[chosen], small.tokens[1:])
        assert torch.equal(big.candidates.depths[chosen], small.depths[1:])
        # Drafting stops after the level whose children could not enter the tree, and the replay knows where.
        levels = int(small.candidates.depths.max())
        assert levels == drafted_depth(ranks, depth, total)
        assert levels >= int(small.depths.max())
        stopped_early += levels < depth
    assert stopped_early  # small budgets on a deep tree stop early


def test_level_rank_stops_only_where_no_deeper_candidate_could_enter():
    scores = torch.tensor([[0.0, -1.0, -2.0, -3.0]] * 3)
    ranks = level_rank(scores, torch.tensor([-1.5, -2.0, -5.0]))
    assert ranks.tolist() == [2, 3, 4]
    # A child scoring -1.5 would be third: it enters a 3-node tree, not a 2-node one. One scoring -2.0 ties the third
    # and loses the tie to the earlier candidate.
    assert (ranks < torch.tensor([3, 3, 5])).tolist() == [True, False, True]


def test_tune_ranks_every_budget_and_restores_the_config(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    before = drafter.generation_config.budget
    result = tune(target, drafter, prompts(target.config.vocab_size, 2), top_ks=(1, 2), max_depth=3,
                  totals=(2, 4, 8), max_new_tokens=16, repeats=1)
    assert drafter.generation_config.budget == before
    budgets = {(e.depth, e.top_k, e.total_tokens) for e in result.estimates}
    # Totals are capped at the tree's size with the root: top_k 1 allows d + 1 tokens, top_k 2 allows 3 + 4 (d - 1).
    assert budgets == {(1, 1, 2), (2, 1, 2), (2, 1, 3), (3, 1, 2), (3, 1, 4), (1, 2, 2), (1, 2, 3),
                       (2, 2, 2), (2, 2, 4), (2, 2, 7), (3, 2, 2), (3, 2, 4), (3, 2, 8)}
    speeds = [e.tokens_per_second for e in result.estimates]
    assert speeds == sorted(speeds, reverse=True)
    for e in result.estimates:
        assert 1.0 <= e.tokens_per_round <= e.depth + 1
        assert e.round_seconds > 0
    assert max(e.tokens_per_round for e in result.estimates) > 1.0  # the fitted drafter is accepted sometimes
    # More nodes at the same width and depth never accept less in the replay.
    by_budget = {(e.depth, e.top_k, e.total_tokens): e.tokens_per_round for e in result.estimates}
    assert by_budget[(3, 2, 8)] >= by_budget[(3, 2, 4)] >= by_budget[(3, 2, 2)]
    assert set(result.verify_seconds) >= {2, 3, 4, 7, 8}
    record = result.record()
    assert record["chosen"] == {"tree_depth": result.best.depth, "tree_top_k": result.best.top_k,
                                "tree_total_tokens": result.best.total_tokens}
    assert format_table(result).count("\n") == 1 + min(12, len(result.estimates))
    assert "verify" in format_costs(result) and "top_k=2" in format_costs(result)


def test_poss_tune_refuses_a_folder_without_a_drafter(tmp_path, capsys):
    assert poss_main(["tune", str(tmp_path), "--prompts", str(tmp_path)]) == 2
    assert "config.json missing" in capsys.readouterr().err


def test_poss_tune_checks_the_prompt_selection_before_loading_anything(tmp_path, capsys):
    prompts_file = tmp_path / "mt_bench.jsonl"
    prompts_file.write_text('{"question_id": 1, "category": "writing", "turns": ["Hi"]}\n')
    missing_target = str(tmp_path / "no-target")
    assert poss_main(["tune", "default", "--target", missing_target, "--prompts", str(prompts_file),
                      "--per-category", "0"]) == 2
    assert "per_category must be >= 1" in capsys.readouterr().err


def test_poss_tune_rejects_bad_lists():
    with pytest.raises(SystemExit):
        poss_main(["tune", "default", "--prompts", "x", "--top-k", "0,2"])


def test_poss_tune_writes_the_budget_and_its_record_only(fitted_pairs, tmp_path, capsys, monkeypatch):
    """`poss tune FOLDER` writes this device kind's entry into `generation_config.json` (beside other kinds' entries
    and the default budget, which stay) and its record into `tuning_record.json`, nothing else of the folder; with
    `--batch-sizes` the entry's `max_batch_size` is the largest measured size where drafting paid."""
    import json

    from tiny_tokenizer import char_tokenizer
    from transformers_poss import tuning
    from transformers_poss.devices import device_kind

    target, drafter = fitted_pairs("llama")
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    other = drafter.with_generation_config()
    other.generation_config.device_budgets = {"cuda:Other GPU/bfloat16": {"tree_depth": 5}}
    other.tuning_record = {"device_kinds": {"cuda:Other GPU/bfloat16": {"chosen": {"tree_depth": 5}}}}
    other.save_pretrained(tmp_path / "drafter")
    untouched = {name: (tmp_path / "drafter" / name).read_bytes() for name in ("config.json", "model.safetensors")}
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "x", "turns": [f"hello there {i}", "again"][:i + 1]}) + "\n"
        for i in range(2)))
    monkeypatch.setattr(tuning, "measure_batches", lambda *args, **kwargs: {1: 1.3, 2: 0.9})
    measure_lookup = tuning.measure_lookup
    measured = {}

    def lookup_measured_for_real(target, drafter, prompts, lengths, max_new_tokens, progress=None):
        measured.update(measure_lookup(target, drafter, prompts, lengths, max_new_tokens, progress))
        return {0: 1.1, 10: 1.4}  # the branch wins here: the entry must say so
    monkeypatch.setattr(tuning, "measure_lookup", lookup_measured_for_real)
    code = poss_main(["tune", str(tmp_path / "drafter"), "--target", str(tmp_path / "target"), "--prompts",
                      str(tmp_path / "prompts.jsonl"), "--dtype", "float32", "--top-k", "1,2", "--max-depth", "2",
                      "--totals", "2,4", "--max-new-tokens", "12", "--repeats", "1", "--batch-sizes", "1,2"])
    assert code == 0, capsys.readouterr().err
    kind = device_kind("cpu", torch.float32)
    records = json.loads((tmp_path / "drafter" / "tuning_record.json").read_text())["device_kinds"]
    assert records["cuda:Other GPU/bfloat16"] == {"chosen": {"tree_depth": 5}} and records[kind]["device_kind"] == kind
    chosen = records[kind]["chosen"]
    settings = json.loads((tmp_path / "drafter" / "generation_config.json").read_text())
    entry = settings["device_budgets"][kind]
    assert entry == {**chosen, "lookup_num_tokens": 10, "max_batch_size": 1} and chosen["tree_depth"] <= 2
    assert set(measured) == {0, 10} and all(speedup > 0 for speedup in measured.values())
    assert records[kind]["lookup_speedups"] == {"0": 1.1, "10": 1.4}
    assert settings["device_budgets"]["cuda:Other GPU/bfloat16"] == {"tree_depth": 5}
    assert settings["tree_depth"] == drafter.generation_config.default_budget["tree_depth"]  # the default budget stays
    assert all((tmp_path / "drafter" / name).read_bytes() == data for name, data in untouched.items())


def test_largest_paying_batch():
    from transformers_poss.tuning import largest_paying_batch

    assert largest_paying_batch({1: 1.5, 2: 1.2, 4: 0.98, 8: 1.1}) == 2  # stops at the first size that lost
    assert largest_paying_batch({1: 0.9, 2: 1.2}) == 0 and largest_paying_batch({1: 1.1, 16: 1.01}) == 16


@pytest.mark.parametrize("int8", [False, True])
def test_draft_timing_drafts_as_generate_would(fitted_pairs, monkeypatch, int8):
    """`poss tune` times drafting with the drafter's own 8-bit setting (and only then with 8-bit products)."""
    from transformers_poss import kernels
    from transformers_poss.tuning import measure_draft_seconds

    target, drafter = fitted_pairs("llama")
    products = []
    product = kernels.int8_product
    monkeypatch.setattr(kernels, "int8_product", lambda *args: products.append(1) or product(*args))
    copy_ = copy.deepcopy(drafter)
    copy_.int8_draft_weights = int8
    seconds = measure_draft_seconds(copy_, target, prompts()[0], depths=[1, 2], top_ks=[2], repeats=1)
    assert sorted(seconds) == [(1, 2), (2, 2)] and all(s > 0 for s in seconds.values())
    assert bool(products) == int8
    assert not drafter.int8_draft_weights


def test_the_fastest_lookup_length_wins_and_a_tie_keeps_the_shorter():
    from transformers_poss.tuning import fastest_lookup

    assert fastest_lookup({0: 1.5, 10: 1.9}) == 10 and fastest_lookup({0: 1.5, 10: 1.2}) == 0
    assert fastest_lookup({0: 1.5, 4: 1.5, 10: 1.5}) == 0
