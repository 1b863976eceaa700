"""vLLM (the poss_vllm plugin) serves the PosS authors' PosS-on-EAGLE-3 layout as their training ran it.

`exports/poss_e3_src` is a random checkpoint in the layout of `HINT-lab/PosS3-E3-Llama3.1-8B-Instruct` (the authors'
SpecForge fork: 3 layers, `architectures: [LlamaForCausalLMPosSEagle3]`, `make_exports.write_poss_e3`), which the
library reads as it is; `exports/poss_e3` is its `poss export --format vllm --target T`. Real vLLM, the default
target, fp32, greedy, the 6 chat prompts, K = 7 (the authors' vLLM evaluation drafts 7, which uses all 3 layers).
Random weights accept little, so the per-layer call counts also show which layer drafts which position.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import HERE, MAX_NEW_TOKENS, main_python, run

K = 7
TOLERANCE = 0.05


def authors_layer(position: int) -> int:
    """The layer the authors' training drafts `position` with: TTT step `forward_num = position - 1`,
    `layer_select(forward_num) = forward_num // 3` (shrango/PosS specforge/specforge/modeling/draft/
    llama3_poss_eagle.py)."""
    return (position - 1) // 3


def planned_calls(k: int, layers: int) -> list[int]:
    """Calls per layer in one round of K draft tokens, by poss_vllm's plan for a shared key/value list
    (`poss_vllm.model._PosSBase._plan`): the first pass (position 1) and each later position's step run that
    position's layer alone, which writes the one KV cache."""
    calls = [0] * layers
    for position in range(1, k + 1):
        calls[authors_layer(position)] += 1
    return calls


@pytest.fixture(scope="module")
def reference_e3(exports, workdir, reference) -> dict:
    """This library's plain answers and chain-mode acceptance at K with the authors' layout read as it is."""
    path = workdir / "library_reference_poss_e3.json"
    run([main_python(), str(HERE / "library_reference.py"), "--drafter", str(exports / "poss_e3_src"), "--depths",
         str(K), "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(path)], timeout=1200)
    return json.loads(path.read_text())


def test_poss_e3_answers_are_token_identical_to_vllm_without_speculation(vllm_runs, reference, reference_e3):
    plain = vllm_runs.get(None)["answers"]
    assert [p["plain_ids"] for p in reference_e3["prompts"]] == [p["plain_ids"] for p in reference["prompts"]]
    assert all(reference_e3["depths"][str(K)]["identical_to_plain"])
    served = vllm_runs.get("poss_e3", K, method="eagle3")
    assert served["answers"] == plain
    assert served["counters"]["spec_decode_num_drafts"] > 0
    assert len(served["counters"]["spec_decode_num_accepted_tokens_per_pos"]) == K


def test_poss_e3_per_position_acceptance_matches_the_library(vllm_runs, reference_e3):
    library = reference_e3["depths"][str(K)]
    served = vllm_runs.get("poss_e3", K, method="eagle3")
    print(f"K={K} vLLM alpha {[round(a, 3) for a in served['alpha']]} counters {served['counters']}")
    print(f"K={K} library alpha {[round(a, 3) for a in library['alpha']]} at_least {library['at_least']}")
    assert len(served["alpha"]) == K
    for position, (ours, theirs) in enumerate(zip(served["alpha"], library["alpha"]), start=1):
        if math.isnan(theirs):
            continue
        assert abs(ours - theirs) <= TOLERANCE, (
            f"K={K} position {position}: vLLM alpha {ours:.3f}, library {theirs:.3f}")


def test_poss_e3_positions_run_the_layers_training_used(vllm_runs):
    """Positions 1-3 on layer 0, 4-6 on layer 1, 7 on layer 2, each alone (the shared key/value list): per round the
    calls are `planned_calls` (3, 3, 1); vLLM's dummy runs add the same count to every layer. Another map (e.g. 2
    positions per layer: 2, 2, 3; the (1, 3, 4) split: 1, 3, 3) gives other differences between layers."""
    calls = vllm_runs.get("poss_e3", K, method="eagle3")["specialist_calls"]
    expected = planned_calls(K, 3)
    print(f"K={K} layer calls {calls}, per round {expected}")
    assert expected == [3, 3, 1] and len(calls) == 3
    rounds, remainder = divmod(calls[-1] - calls[0], expected[-1] - expected[0])
    assert rounds > 0 and remainder == 0, calls
    assert [c - calls[0] for c in calls] == [rounds * (e - expected[0]) for e in expected], calls
