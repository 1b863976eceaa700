"""Speculative sampling keeps the target distribution (and a wrong acceptance rule is caught by the same test)."""

import copy
import itertools

import pytest
import torch
from scipy.stats import chisquare

from tiny_models import DEVICE, fitted_drafter, tiny_target
from transformers_poss.generation import acceptance
from transformers_poss.generation.drafting import DraftTree

VOCAB = 8
NEW_TOKENS = 4
SAMPLES = 300
ALPHA = 1e-3  # a correct sampler fails one run in a thousand


def _exact_marginals(target, prompt, temperature):
    """Exact distribution of each of the first NEW_TOKENS tokens under plain sampling, by enumeration."""
    marginals = torch.zeros(NEW_TOKENS, VOCAB, dtype=torch.float64)
    for prefix_len in range(NEW_TOKENS):
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            prefix_ids = torch.tensor([prefix], dtype=torch.long, device=prompt.device).reshape(1, -1)
            ids = torch.cat((prompt, prefix_ids), dim=1)
            with torch.no_grad():
                logits = target(ids).logits[0].double().cpu() / temperature
            prob_prefix = 1.0
            for i, token in enumerate(prefix):
                prob_prefix *= torch.softmax(logits[prompt.shape[1] - 1 + i], -1)[token].item()
            marginals[prefix_len] += prob_prefix * torch.softmax(logits[-1], -1)
    return marginals


def _p_values(samples, marginals):
    counts = torch.zeros(NEW_TOKENS, VOCAB, dtype=torch.float64)
    for sample in samples:
        for i, token in enumerate(sample):
            counts[i, token] += 1
    values = []
    for i in range(NEW_TOKENS):
        expected = marginals[i] * len(samples)
        keep = expected > 0
        values.append(chisquare(counts[i][keep].numpy(), expected[keep].numpy() * counts[i].sum().item()
                                / expected[keep].sum().item()).pvalue)
    return values


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab_size=VOCAB, seed=5)
    drafter = fitted_drafter(target, tree_depth=3, tree_top_k=3, tree_total_tokens=10, steps=200)
    prompt = torch.tensor([[1, 4, 2, 7, 3]], device=DEVICE)
    return target, drafter, prompt


def _check_sampling(target, drafter, prompt, lookup_tokens=0):
    """Draw SAMPLES speculative samples and test each position's marginal against plain sampling's exact one."""
    temperature = 0.7
    marginals = _exact_marginals(target, prompt, temperature)
    torch.manual_seed(0)
    samples, accepted, from_lookup = [], 0, 0
    for _ in range(SAMPLES):
        out = target.generate(prompt, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=NEW_TOKENS, assistant_model=drafter, return_dict_in_generate=True)
        samples.append(out.sequences[0, prompt.shape[1]:].tolist())
        accepted += sum(out.speculative_stats.acceptance_lengths)
        from_lookup += out.speculative_stats.lookup_tokens
    assert accepted > SAMPLES // 5, "drafts were rarely accepted: the test would not exercise acceptance"
    assert (from_lookup >= 5) == bool(lookup_tokens), from_lookup  # grafted nodes were accepted, and only then
    p_values = _p_values(samples, marginals)
    assert min(p_values) > ALPHA / NEW_TOKENS, p_values


@pytest.mark.parametrize("mode,lookup_tokens,int8", [
    ("tree", 0, False), ("chain", 0, False), ("tree", 3, False), ("chain", 0, True)])
def test_speculative_sampling_matches_target_distribution(setup, mode, lookup_tokens, int8):
    target, drafter, prompt = setup
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_mode, drafter.generation_config.lookup_num_tokens = mode, lookup_tokens
    drafter.int8_draft_weights = int8  # chain mode: q from the 8-bit products that drew the draft
    if lookup_tokens:  # a small drafted tree and a repetitive prompt, so that grafted nodes get accepted
        drafter.generation_config.tree_total_tokens, prompt = 3, torch.cat((prompt, prompt), dim=1)
    _check_sampling(target, drafter, prompt, lookup_tokens)


@pytest.mark.parametrize("shape", [{"position_groups": [1, 2]}, {"position_groups": [1, 2], "lora_rank": 4}],
                         ids=["uneven-groups", "lora-specialists"])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_new_specialist_kinds_keep_the_target_distribution(shape, mode):
    """Position 1 drafts with specialist 0, positions 2-3 with specialist 1 (a full layer or a LoRA adapter)."""
    target = tiny_target("llama", vocab_size=VOCAB, seed=5)
    drafter = fitted_drafter(target, num_specialists=2, tree_depth=3, tree_top_k=3, tree_total_tokens=10,
                             steps=200, **shape)
    drafter.generation_config.draft_mode = mode
    _check_sampling(target, drafter, torch.tensor([[1, 4, 2, 7, 3]], device=DEVICE))


def _wrong_accept_sampling(processed, tree):
    """A deliberately wrong rule: accept a drafted child with probability p(t) but resample from the unmodified p."""
    tokens, children = tree.tokens.tolist(), acceptance.children(tree)
    path = [0]
    while True:
        probs = torch.softmax(processed[path[-1]], -1)
        child = next((c for c in children[path[-1]] if torch.rand(()) < probs[tokens[c]] * 2), None)
        if child is None:
            return path, torch.multinomial(probs, 1)[0]
        path.append(child)


@pytest.mark.parametrize("rule,should_pass", [(acceptance.accept_sampling, True), (_wrong_accept_sampling, False)])
def test_acceptance_rule_is_exact_and_test_has_power(rule, should_pass):
    """One tree level, many trials: the first emitted token must follow the target distribution p exactly."""
    torch.manual_seed(1)
    logits = torch.tensor([[1.2, 0.3, -0.5, 0.9, 0.0, -1.0]])
    children = torch.tensor([0, 3, 1])
    tree = DraftTree(tokens=torch.cat((torch.tensor([5]), children)), parents=torch.tensor([-1, 0, 0, 0]),
                     depths=torch.tensor([0, 1, 1, 1]), visible=torch.eye(4, dtype=torch.bool))
    processed = torch.cat((logits, torch.zeros(3, 6)))
    trials = 6000
    counts = torch.zeros(6)
    for _ in range(trials):
        path, bonus = rule(processed.clone(), tree)
        first = tree.tokens[path[1]] if len(path) > 1 else bonus
        counts[int(first)] += 1
    p_value = chisquare(counts.numpy(), (torch.softmax(logits[0], -1) * trials).numpy()).pvalue
    assert (p_value > ALPHA) == should_pass, p_value
