"""`poss distill --server` against a real `vllm serve` of the default target (fp32, greedy): the records equal the
library's own fp32 answers (`poss distill` without `--server`, one conversation at a time), a rerun resumes, and a
model name the server does not serve is refused.

Run with vLLM's python: `.venv-vllm/bin/python -m pytest -q tests_vllm -k distill` (fixtures: conftest.py). The
`poss` commands run in the main environment's python (`main_python()`).
"""

from __future__ import annotations

import json
import re

from conftest import main_python, run, vllm_serve
from library_reference import PROMPTS

MAX_NEW_TOKENS = 64


def _records(path) -> dict:
    return {r["id"]: r["conversations"] for r in map(json.loads, open(path, encoding="utf-8"))}


def _summary(output: str) -> dict:
    """The JSON counts `poss distill` prints last (its output and logs share the stream)."""
    return json.loads(re.findall(r"^\{$.*?^\}$", output, re.S | re.M)[-1])


def test_poss_distill_through_vllm_serve_gives_the_library_answers(target, tmp_path):
    records = [{"id": f"q{i}", "conversations": [{"from": "human", "value": prompt}]}
               for i, prompt in enumerate(PROMPTS[:4])]
    records.append({"id": "two-turns", "conversations": [{"from": "human", "value": PROMPTS[4]},
                                                         {"from": "human", "value": "Now in German, please."}]})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
    distill = [main_python(), "-m", "transformers_poss.cli", "distill", "--target", target, "--data", str(prompts),
               "--max-new-tokens", str(MAX_NEW_TOKENS)]
    local = tmp_path / "local.jsonl"
    run([*distill, "--target-dtype", "float32", "--batch-size", "1", "--output", str(local)], timeout=1200)

    served = tmp_path / "served.jsonl"
    with vllm_serve(target, tmp_path / "serve.log", "--max-model-len", "2048") as url:
        out = run([*distill, "--server", f"{url}/v1", "--concurrency", "4", "--output", str(served)], timeout=900)
        summary = _summary(out.stdout)
        print(json.dumps(summary["server"], indent=1))
        again = _summary(run([*distill, "--server", f"{url}/v1", "--output", str(served)], timeout=600).stdout)
        refused = run([*distill, "--server", f"{url}/v1", "--model", "another-model", "--output",
                       str(tmp_path / "refused.jsonl")], timeout=600, check=False)

    assert summary["written"] == 5 and summary["answers"] == 6 and summary["failed"] == 0
    assert summary["server"]["model"] == target and summary["server"]["prompts"] == "token ids"
    checks = " | ".join(summary["server"]["checks"])
    assert "token ids equal the target tokenizer's" in checks and "answers as token ids" in checks
    assert _records(served) == _records(local), "vLLM's answers differ from the library's fp32 answers"
    assert again["written"] == 0 and again["skipped_done"] == 5
    assert refused.returncode != 0 and "does not serve --model 'another-model'" in refused.stdout
    assert not (tmp_path / "refused.jsonl").exists()
