"""`poss distill --server` / `server_distill` against a loopback OpenAI-compatible server (tests/openai_server.py)
that answers with a tiny target's own greedy generate: the records equal `self_distill`'s, resume, concurrency,
retries then counted failures, and the servers refused before any work."""

from __future__ import annotations

import json
import logging
import re
import socket

import pytest

from openai_server import FakeOpenAIServer
from test_distill import read_jsonl
from test_training import CONVERSATION, SMOLLM2_TEMPLATE, make_tokenizer
from tiny_models import tiny_target
from tiny_tokenizer import char_tokenizer
from transformers_poss.training import self_distill
from transformers_poss.training.distill import NoUsableRecordsError
from transformers_poss.training.distill_server import ServerError, server_distill

RECORDS = [
    {"id": "p0", "conversations": [{"from": "human", "value": "u1 u2"}]},
    {"id": "p1", "messages": [{"role": "system", "content": "s1"}, {"role": "user", "content": "u3"}]},
    {"id": "p2", "conversations": [{"from": "human", "value": "u4"}, {"from": "human", "value": "u5 u6"}]},
    dict(CONVERSATION, id="c0"),
    {"id": "p3", "conversations": [{"from": "human", "value": "u7 u8 u9"}]},
    {"id": "bad", "conversations": [{"from": "gpt", "value": "a1"}]},
]


@pytest.fixture(scope="module")
def tiny_pair():
    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    return tiny_target("llama", vocab_size=len(tokenizer)), tokenizer


@pytest.fixture(scope="module")
def local_answers(tiny_pair, tmp_path_factory):
    """`self_distill`'s records and counts of `RECORDS` (5 new tokens, batches of 4)."""
    target, tokenizer = tiny_pair
    path = tmp_path_factory.mktemp("local") / "local.jsonl"
    stats = self_distill(target, tokenizer, RECORDS, str(path), batch_size=4, max_new_tokens=5, progress=False)
    return read_jsonl(path), stats


def question(prompt: str) -> str:
    """The user word of a one-question prompt as the server decodes it."""
    (word,) = re.findall(r"\bu\d+\b", prompt)
    return word


def bos_adding_tokenizer():
    """The target's tokenizer, but adding its BOS token in front of every text it tokenizes."""
    from tokenizers import processors

    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    return tokenizer


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_server_answers_equal_local_generate_and_a_rerun_resumes(tiny_pair, local_answers, tmp_path):
    target, tokenizer = tiny_pair
    local, local_stats = local_answers
    out = tmp_path / "served.jsonl"
    with FakeOpenAIServer(target, tokenizer, delay=0.05, max_model_len=1024) as server:
        stats = server_distill(tokenizer, RECORDS, str(out), server.url, concurrency=3, max_new_tokens=5,
                               progress=False)
    assert read_jsonl(out) == local and len(local) == 5
    for key in ("records", "written", "answers", "skipped_invalid", "skipped_by_reason", "generated_tokens"):
        assert stats[key] == local_stats[key], key
    assert stats["failed"] == 0 and stats["not_attempted"] == 0
    assert stats["server"]["model"] == "tiny-target" and stats["server"]["prompts"] == "token ids"
    checks = " | ".join(stats["server"]["checks"])
    assert "max_model_len 1024 < --max-prompt-length + --max-new-tokens = 2053" in checks
    assert "token ids equal the target tokenizer's" in checks
    assert f"last token id {len(tokenizer) - 1} accepted" in checks and "answers as token ids" in checks
    assert server.max_in_flight > 1  # conversations in flight together
    assert len(server.completions) == stats["answers"] == 8

    # Interrupted after two records (and half a line): the rerun answers the rest only.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])
    with FakeOpenAIServer(target, tokenizer) as server:
        again = server_distill(tokenizer, RECORDS, str(out), server.url, concurrency=2, max_new_tokens=5,
                               progress=False)
    assert again["skipped_done"] == 2 and again["written"] == 3
    assert read_jsonl_tolerant(out) == local
    # Nothing left: the rerun writes nothing and contacts no server.
    done = server_distill(tokenizer, RECORDS, str(out), closed_port_url(), max_new_tokens=5, progress=False)
    assert done["written"] == 0 and done["skipped_done"] == 5 and "server" not in done


def read_jsonl_tolerant(path) -> dict:
    records = {}
    for line in open(path, encoding="utf-8"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[record["id"]] = record["conversations"]
    return records


@pytest.mark.parametrize("concurrency", [1, 4])
def test_concurrency_bounds_the_requests_in_flight(tiny_pair, tmp_path, concurrency):
    target, tokenizer = tiny_pair
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"u{i}"}]} for i in range(8)]
    with FakeOpenAIServer(target, tokenizer, delay=0.1) as server:
        stats = server_distill(tokenizer, records, str(tmp_path / "out.jsonl"), server.url, concurrency=concurrency,
                               max_new_tokens=2, progress=False)
    assert stats["written"] == 8
    assert server.max_in_flight == 1 if concurrency == 1 else 1 < server.max_in_flight <= concurrency


def test_text_prompt_server_gives_the_same_records(tiny_pair, local_answers, tmp_path):
    """A server that takes text prompts only and has no /tokenize (as `transformers serve`): the rendered text goes,
    after the probe showed the server reads it as the target's tokenizer does."""
    target, tokenizer = tiny_pair
    out = tmp_path / "served.jsonl"
    with FakeOpenAIServer(target, tokenizer, token_ids=False, tokenize=False) as server:
        stats = server_distill(tokenizer, RECORDS, str(out), server.url, concurrency=2, max_new_tokens=5,
                               progress=False)
    assert read_jsonl(out) == local_answers[0]
    assert stats["server"]["prompts"] == "text"
    checks = " | ".join(stats["server"]["checks"])
    assert "/tokenize: not offered (HTTP 404)" in checks and "token ids refused: token ids: HTTP 422" in checks
    assert "read as the target tokenizer's" in checks


def test_failed_requests_are_retried_then_counted(tiny_pair, tmp_path, caplog):
    target, tokenizer = tiny_pair
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"u{i}"}]} for i in range(1, 6)]

    def fail(prompt: str, attempt: int):
        word = question(prompt)
        if word == "u1":
            return 503 if attempt <= 2 else None  # recovers within the retries
        if word == "u2":
            return 500  # never recovers
        if word == "u3":
            return 400  # refused: not retried
        return None

    out = tmp_path / "out.jsonl"
    with FakeOpenAIServer(target, tokenizer, fail=fail) as server, \
            caplog.at_level(logging.WARNING, logger="transformers_poss.training.distill_server"):
        stats = server_distill(tokenizer, records, str(out), server.url, concurrency=2, max_new_tokens=3,
                               retries=2, retry_wait=0.01, progress=False)
        attempts = {question(prompt): n for prompt, n in server.attempts.items()}
    assert attempts == {"u1": 3, "u2": 3, "u3": 1, "u4": 1, "u5": 1}
    assert stats["written"] == 3 and sorted(read_jsonl(out)) == ["r1", "r4", "r5"]
    assert stats["failed"] == 2 and stats["failed_by_reason"] == {"HTTP 500": 1, "HTTP 400": 1}
    assert "record r2 failed (2 retries): HTTP 500: failing on purpose" in caplog.text
    # The rerun retries the failed records only.
    with FakeOpenAIServer(target, tokenizer) as server:
        again = server_distill(tokenizer, records, str(out), server.url, max_new_tokens=3, progress=False)
    assert again["written"] == 2 and again["skipped_done"] == 3 and len(server.completions) == 2
    assert sorted(read_jsonl(out)) == ["r1", "r2", "r3", "r4", "r5"]


def test_a_server_that_stops_answering_stops_the_run(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"u{i % 30}"}]} for i in range(64)]
    with FakeOpenAIServer(target, tokenizer, fail=lambda prompt, attempt: 503) as server:
        stats = server_distill(tokenizer, records, str(tmp_path / "out.jsonl"), server.url, concurrency=2,
                               max_new_tokens=2, retries=0, progress=False)
    assert "16 records in a row got no answer" in stats["stopped"]
    assert stats["written"] == 0 and stats["failed"] >= 16 and stats["not_attempted"] > 0
    assert stats["failed"] + stats["not_attempted"] == 64 and sum(server.attempts.values()) == stats["failed"]


@pytest.mark.parametrize("case, match", [
    ("down", "cannot reach a server at http://127.0.0.1:"),
    ("other api", "does not speak the OpenAI API: GET .*/models answered HTTP 404"),
    ("html", "does not speak the OpenAI API: GET .*/models answered bad response"),
    ("unknown model", "does not serve --model 'other'; it serves \\['tiny-target'\\]"),
    ("other tokenizer", "has another tokenizer than the target: the first prompt is 102 tokens there, 23 with"),
    ("smaller vocabulary", "refuses the target's last token id 79 .*out of vocabulary.*smaller than the target's"),
    ("text, BOS added", "reads the first prompt as 24 tokens, the target's tokenizer as 23"),
])
def test_servers_that_cannot_answer_for_the_target_are_refused_before_any_work(tiny_pair, tmp_path, case, match):
    target, tokenizer = tiny_pair
    options = {"other api": {"api": "other"}, "html": {"api": "html"},
               "other tokenizer": {"tokenizer": char_tokenizer()},
               "smaller vocabulary": {"tokenize": False, "vocab_size": len(tokenizer) - 1},
               "text, BOS added": {"tokenizer": bos_adding_tokenizer(), "token_ids": False, "tokenize": False}}
    settings = {"tokenizer": tokenizer, **options.get(case, {})}
    out = tmp_path / "out.jsonl"
    with FakeOpenAIServer(target, **settings) as server:
        url = closed_port_url() if case == "down" else server.url
        with pytest.raises(ServerError, match=match):
            server_distill(tokenizer, RECORDS, str(out), url, model="other" if case == "unknown model" else None,
                           max_new_tokens=3, progress=False)
        assert server.completions == []
    assert not out.exists()


def test_a_server_with_an_api_key_needs_it(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    records = [{"id": "0", "conversations": [{"from": "human", "value": "u1"}]}]
    with FakeOpenAIServer(target, tokenizer, api_key="secret") as server:
        with pytest.raises(ServerError, match=r"refused the request \(HTTP 401: Unauthorized\).*\(--api-key\)"):
            server_distill(tokenizer, records, str(tmp_path / "out.jsonl"), server.url, progress=False)
        stats = server_distill(tokenizer, records, str(tmp_path / "out.jsonl"), server.url, api_key="secret",
                               max_new_tokens=2, progress=False)
    assert stats["written"] == 1


def test_no_usable_record_is_refused_before_the_server_is_contacted(tiny_pair, tmp_path):
    _, tokenizer = tiny_pair
    with pytest.raises(NoUsableRecordsError, match="none of the 1 records.*1 no_user_turn"):
        server_distill(tokenizer, [{"conversations": [{"from": "gpt", "value": "a1"}]}], str(tmp_path / "o.jsonl"),
                       closed_port_url(), progress=False)


def test_command_line_through_a_server(tiny_pair, local_answers, tmp_path, capsys):
    from transformers_poss.cli import main

    target, tokenizer = tiny_pair
    tokenizer.save_pretrained(tmp_path / "target")  # the tokenizer is all `--server` loads
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    common = ["distill", "--target", str(tmp_path / "target"), "--data", str(prompts), "--max-new-tokens", "5"]
    out = tmp_path / "served.jsonl"
    with FakeOpenAIServer(target, tokenizer) as server:
        assert main([*common, "--server", server.url, "--output", str(out), "--concurrency", "2"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["written"] == 5 and summary["skipped_by_reason"] == {"no_user_turn": 1}
        assert summary["server"]["prompts"] == "token ids" and len(summary["server"]["checks"]) == 3  # no warning
        assert read_jsonl(out) == local_answers[0]
        with pytest.raises(SystemExit, match="--drafter speeds up the local target"):
            main([*common, "--server", server.url, "--output", str(tmp_path / "x.jsonl"), "--drafter", "default"])
    with pytest.raises(SystemExit, match="--concurrency must be >= 1"):
        main([*common, "--server", closed_port_url(), "--output", str(tmp_path / "x.jsonl"), "--concurrency", "0"])
    with pytest.raises(SystemExit, match="poss distill: error: --server: cannot reach a server"):
        main([*common, "--server", closed_port_url(), "--output", str(tmp_path / "down.jsonl")])
    refuse_p3 = lambda prompt, attempt: 400 if "u7 u8 u9" in prompt else None  # noqa: E731
    with FakeOpenAIServer(target, tokenizer, fail=refuse_p3) as server:
        with pytest.raises(SystemExit) as failed:
            main([*common, "--server", server.url, "--output", str(tmp_path / "part.jsonl"), "--retries", "0"])
    message = str(failed.value.code)
    assert message.startswith("poss distill: error: 1 records failed (1 HTTP 400)")
    assert "the 4 records answered are written: rerun the same command" in message
    assert json.loads(capsys.readouterr().out)["failed"] == 1
