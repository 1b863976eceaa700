"""`poss distill` / `self_distill`: prompts get answered, full conversations get their answers regenerated, records
with nothing to answer are counted by reason, and data with no usable record is refused with the expected shape."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from test_training import CONVERSATION, SMOLLM2_TEMPLATE, make_tokenizer
from tiny_models import DEVICE, tiny_target
from transformers_poss.training import self_distill
from transformers_poss.training.distill import NoUsableRecordsError, check_records, distillation_turns

ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


@pytest.fixture(scope="module")
def tiny_pair():
    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    return tiny_target("llama", vocab_size=len(tokenizer)), tokenizer


def answer_alone(target, tokenizer, turns: list[dict], max_new_tokens: int) -> str:
    """What the target answers after ShareGPT `turns`, generated on its own (greedy)."""
    history = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(DEVICE)
    new = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def read_jsonl(path) -> dict[str, list[dict]]:
    return {record["id"]: record["conversations"] for record in map(json.loads, open(path, encoding="utf-8"))}


def test_distillation_turns_mark_every_answer_to_generate():
    human = lambda text: {"from": "human", "value": text}
    gpt = lambda text: {"from": "gpt", "value": text}
    roles = lambda record: [m["role"] for m in distillation_turns(record)]
    assert roles({"conversations": [human("u1")]}) == ["user", "assistant"]
    assert roles({"conversations": [human("u1"), human("u2")]}) == ["user", "assistant", "user", "assistant"]
    # A full conversation keeps its shape (two user turns before one answer stay one question) ...
    assert roles({"conversations": [human("u1"), human("u2"), gpt("a1")]}) == ["user", "user", "assistant"]
    # ... and its unanswered user turns at the end get answers; a leading assistant turn answers nothing.
    assert roles({"conversations": [gpt("a0"), human("u1"), gpt("a1"), human("u2"), human("u3")]}) == \
        ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert roles({"messages": [{"role": "system", "content": "s1"}, {"role": "user", "content": "u1"}]}) == \
        ["system", "user", "assistant"]
    assert distillation_turns({"conversations": [human("u1")]})[-1]["content"] == ""


def test_prompts_only_records_are_answered(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    records = [
        {"id": "p0", "conversations": [{"from": "human", "value": "u1 u2"}]},
        {"id": "p1", "messages": [{"role": "system", "content": "s1"}, {"role": "user", "content": "u3"}]},
        {"id": "p2", "conversations": [{"from": "human", "value": "u4"}, {"from": "human", "value": "u5 u6"}]},
    ]
    out = tmp_path / "answers.jsonl"
    stats = self_distill(target, tokenizer, records, str(out), batch_size=2, max_new_tokens=3, progress=False)
    assert stats["written"] == 3 and stats["answers"] == 4 and stats["skipped_invalid"] == 0
    written = read_jsonl(out)
    assert [t["from"] for t in written["p0"]] == ["human", "gpt"]
    assert [t["from"] for t in written["p1"]] == ["system", "human", "gpt"]
    assert [t["from"] for t in written["p2"]] == ["human", "gpt", "human", "gpt"]
    for turns in written.values():  # every answer is the target's own, after the target's own earlier answers
        for index, turn in enumerate(turns):
            if turn["from"] == "gpt":
                assert turn["value"] == answer_alone(target, tokenizer, turns[:index], 3)
    # --max-turns 1 on a multi-turn prompt: the first question and its answer, the same as in the full run.
    first = tmp_path / "first.jsonl"
    self_distill(target, tokenizer, records[2:], str(first), max_new_tokens=3, progress=False, max_turns=1)
    assert read_jsonl(first)["p2"] == written["p2"][:2]


def test_full_conversations_are_regenerated_and_their_last_question_answered(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    out = tmp_path / "distilled.jsonl"
    stats = self_distill(target, tokenizer, [dict(CONVERSATION, id="c0")], str(out), max_new_tokens=3,
                         progress=False)
    assert stats["written"] == 1 and stats["answers"] == 3
    turns = read_jsonl(out)["c0"]
    assert [t["from"] for t in turns] == ["system", "human", "gpt", "human", "gpt", "human", "gpt"]
    original = CONVERSATION["conversations"]
    assert [t["value"] for t in turns if t["from"] != "gpt"] == [t["value"] for t in original if t["from"] != "gpt"]
    assert turns[2]["value"] != original[2]["value"].strip()  # regenerated
    assert turns[6]["value"] == answer_alone(target, tokenizer, turns[:6], 3)  # the unanswered last turn, answered


def test_unusable_records_are_counted_by_reason(tiny_pair, tmp_path, caplog):
    target, tokenizer = tiny_pair
    long_prompt = " ".join(f"u{i % 30}" for i in range(80))
    records = [
        {"id": "ok", "conversations": [{"from": "human", "value": "u1"}]},
        {"id": "empty", "conversations": []},
        {"id": "blank", "conversations": [{"from": "human", "value": "  "}]},
        {"id": "only-answers", "conversations": [{"from": "system", "value": "s1"}, {"from": "gpt", "value": "a1"}]},
        {"id": "alien", "conversations": [{"from": "alien", "value": "u1"}]},
        {"id": "bad-role", "messages": [{"role": "robot", "content": "u1"}]},
        {"id": "no-text", "conversations": [{"from": "human", "value": {"text": "u1"}}]},
        {"id": "prompt", "prompt": "u1"},
        "u1 as a bare string",
        {"id": "long", "conversations": [{"from": "human", "value": long_prompt}]},
    ]
    out = tmp_path / "distilled.jsonl"
    with caplog.at_level(logging.WARNING, logger="transformers_poss.training.distill"):
        stats = self_distill(target, tokenizer, records, str(out), max_new_tokens=2, max_prompt_length=40,
                             progress=False)
    assert stats["written"] == 1 and list(read_jsonl(out)) == ["ok"]
    assert stats["skipped_by_reason"] == {"empty": 2, "no_user_turn": 1, "unknown_role": 2, "bad_turn": 1,
                                          "not_a_conversation": 2, "prompt_too_long": 1}
    assert stats["skipped_invalid"] == 9
    assert "skipped 9 of 10 records" in caplog.text and "2 unknown_role" in caplog.text
    assert check_records(records) == (2, {"empty": 2, "no_user_turn": 1, "unknown_role": 2, "bad_turn": 1,
                                          "not_a_conversation": 2})  # no tokenizer: long prompts pass
    # A rerun skips what was written and still counts the rest.
    again = self_distill(target, tokenizer, records, str(out), max_new_tokens=2, max_prompt_length=40,
                         progress=False)
    assert again["written"] == 0 and again["skipped_done"] == 1 and again["skipped_invalid"] == 9


def test_no_usable_record_is_an_error_naming_the_expected_shape(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    out = tmp_path / "distilled.jsonl"
    bad = [{"id": "a", "conversations": [{"from": "gpt", "value": "a1"}]}, {"text": "u1"}]
    with pytest.raises(NoUsableRecordsError, match=r"none of the 2 records.*1 not_a_conversation.*1 no_user_turn"
                                                   r".*\{\"conversations\": \[\{\"from\": \"human\""):
        self_distill(target, tokenizer, bad, str(out), progress=False)
    with pytest.raises(NoUsableRecordsError, match="1 prompt_too_long"):
        self_distill(target, tokenizer, [{"conversations": [{"from": "human", "value": "u1 u2"}]}], str(out),
                     max_prompt_length=3, progress=False)
    with pytest.raises(NoUsableRecordsError, match="no records"):
        self_distill(target, tokenizer, [], str(out), progress=False)
    assert not out.exists()


def test_command_line_answers_prompts_then_features_read_them(tiny_pair, tmp_path, capsys):
    from transformers_poss.cli import main

    target, tokenizer = tiny_pair
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"u{i} u{i + 1}"}]}
                                   for i in range(5)] + [{"conversations": [{"from": "alien", "value": "u1"}]}]))
    common = ["--target", str(tmp_path / "target"), "--target-dtype", "float32"]
    distilled = tmp_path / "distilled.jsonl"
    assert main(["distill", *common, "--data", str(prompts), "--output", str(distilled), "--max-new-tokens", "4",
                 "--max-turns", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["written"] == 5 and summary["skipped_by_reason"] == {"unknown_role": 1}
    written = read_jsonl(distilled)
    assert len(written) == 5 and all([t["from"] for t in turns] == ["human", "gpt"] for turns in written.values())
    assert main(["features", *common, "--data", str(distilled), "--output", str(tmp_path / "features"),
                 "--max-length", "64"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["examples"] == sum(bool(turns[1]["value"]) for turns in written.values()) > 0


def test_command_line_refuses_unusable_data_before_loading_the_target(tmp_path):
    from transformers_poss.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "u1"}\n{"conversations": [{"from": "gpt", "value": "a1"}]}\n')
    missing_target = ["--target", str(tmp_path / "no-such-target"), "--output", str(tmp_path / "out.jsonl")]
    with pytest.raises(SystemExit) as refused:
        main(["distill", "--data", str(bad), *missing_target])
    message = str(refused.value.code)
    assert message.startswith("poss distill: error:") and "1 not_a_conversation" in message
    assert '{"conversations": [{"from": "human", "value": "..."}' in message and '"messages"' in message
    empty = tmp_path / "empty.json"
    empty.write_text("")
    for command in ("distill", "features"):
        with pytest.raises(SystemExit, match=f"poss {command}: error: .*empty.json is empty"):
            main([command, "--data", str(empty), *missing_target])
    # As a process: a non-zero exit status, the message on stderr.
    result = subprocess.run([sys.executable, "-m", "transformers_poss.cli", "distill", "--data", str(bad),
                             *missing_target], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "poss distill: error:" in result.stderr and "no_user_turn" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
