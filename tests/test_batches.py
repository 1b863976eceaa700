"""Batched tree decoding: every row of a left-padded batch is the row plain batched `generate` gives, and the row
generated alone; rows end at different times; sampling keeps each row's distribution."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from test_sampling import ALPHA, NEW_TOKENS, SAMPLES, _exact_marginals, _p_values, _wrong_accept_sampling
from test_sampling import setup as sampling_setup  # noqa: F401 (the fixture: a tiny target and its drafter)
from tiny_models import DEVICE, FAMILIES, prompts
from transformers_poss.generation import acceptance, cache_surgery, decoding, verification


def left_padded(rows: list[torch.LongTensor], pad_token_id: int = 0) -> dict:
    """`input_ids` and `attention_mask` `[B, longest]` of prompts `[1, n_b]`, padded on the left as a tokenizer
    with `padding_side="left"` pads them."""
    longest = max(row.shape[1] for row in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long, device=DEVICE)
    attention_mask = torch.zeros(len(rows), longest, dtype=torch.long, device=DEVICE)
    for b, row in enumerate(rows):
        input_ids[b, longest - row.shape[1] :] = row[0]
        attention_mask[b, longest - row.shape[1] :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def _batch_rows() -> list[torch.LongTensor]:
    """Prompts of very different lengths (5 to 42 tokens); the long one repeats itself for the lookup branch."""
    short, middle, long = prompts(count=3)
    return [short, torch.cat((long, long, long), dim=1), middle]


def _check_batch(target, drafter, rows, **kwargs):
    """Speculative batch == plain batched generate, and each row == the row alone; returns the speculative output."""
    batch = left_padded(rows)
    reference = target.generate(**batch, do_sample=False, **kwargs)
    out = target.generate(**batch, do_sample=False, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(reference, out.sequences), kwargs
    width = batch["input_ids"].shape[1]
    for b, row in enumerate(rows):
        alone = target.generate(row, do_sample=False, **kwargs)[0, row.shape[1] :]
        generated = out.sequences[b, width : width + alone.shape[0]]
        assert torch.equal(alone, generated), (b, kwargs)
    assert len(out.row_stats) == len(rows)
    pooled = out.speculative_stats
    assert pooled.acceptance_lengths == [a for stats in out.row_stats for a in stats.acceptance_lengths]
    assert pooled.new_tokens == sum(stats.new_tokens for stats in out.row_stats)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_rows_match_plain_batched_generate_and_each_row_alone(fitted_pairs, family, attn):
    target, drafter = fitted_pairs(family, attn)
    drafter = drafter.with_generation_config(draft_mode="tree")
    out = _check_batch(target, drafter, _batch_rows(), max_new_tokens=30)
    rounds = [stats.acceptance_lengths for stats in out.row_stats]
    assert all(stats.new_tokens == 30 for stats in out.row_stats)
    # Rows accepted different numbers of tokens in the same round: the cache held holes.
    assert any(len(set(accepted)) > 1 for accepted in zip(*rounds)), rounds


@pytest.mark.parametrize("max_holes", [0, 3, 10_000])
def test_cache_holes_left_or_realigned_give_the_same_rows(fitted_pairs, monkeypatch, max_holes):
    """Rows that accept fewer tokens than the longest path leave holes in the cache; re-aligning them away after
    every round, now and then, or never must not change a token."""
    target, drafter = fitted_pairs("mistral")
    monkeypatch.setattr(decoding, "MAX_HOLES", max_holes)
    realign, calls = cache_surgery.realign, []
    monkeypatch.setattr(decoding, "realign", lambda cache, valid: calls.append(1) or realign(cache, valid))
    _check_batch(target, drafter.with_generation_config(draft_mode="tree"), _batch_rows(), max_new_tokens=30)
    assert (len(calls) > 0) == (max_holes < 10_000), calls


@pytest.mark.parametrize("lookup_tokens", [0, 6])
@pytest.mark.parametrize(
    "budget",
    [dict(tree_depth=4, tree_top_k=3, tree_total_tokens=1), dict(tree_depth=3, tree_top_k=2, tree_total_tokens=500),
     dict(tree_depth=6, tree_top_k=4, tree_total_tokens=20)],
)
def test_batch_budgets_with_and_without_the_lookup_branch(fitted_pairs, budget, lookup_tokens):
    target, drafter = fitted_pairs("llama")
    view = drafter.with_generation_config(draft_mode="tree", lookup_num_tokens=lookup_tokens, **budget)
    out = _check_batch(target, view, _batch_rows(), max_new_tokens=25)
    for stats in out.row_stats:
        assert max(stats.tree_sizes) <= budget["tree_total_tokens"] + lookup_tokens
        assert max(stats.acceptance_lengths) <= budget["tree_depth"] + lookup_tokens
    if lookup_tokens and budget["tree_total_tokens"] > 1:
        assert out.speculative_stats.lookup_tokens > 0, "the lookup branch was never accepted"


def test_batch_with_every_tree_row_projected_in_the_forward(fitted_pairs, monkeypatch):
    """The 16-bit / accelerator rule (every node's logits from the verification forward), forced in fp32."""
    target, drafter = fitted_pairs("gemma3")
    monkeypatch.setattr(verification, "keeps_every_tree_row", lambda model: True)
    _check_batch(target, drafter.with_generation_config(draft_mode="tree"), _batch_rows(), max_new_tokens=20)


@pytest.mark.parametrize("lookup_tokens", [0, 6])
def test_rows_ending_at_different_times_and_max_new_tokens_per_row(fitted_pairs, lookup_tokens):
    target, drafter = fitted_pairs("qwen2")
    drafter = drafter.with_generation_config(draft_mode="tree", lookup_num_tokens=lookup_tokens)
    rows = _batch_rows()
    free_runs = [target.generate(row, do_sample=False, max_new_tokens=30)[0, row.shape[1] :].tolist() for row in rows]
    # Row 0 ends at its first token, row 1 about halfway, row 2 runs to max_new_tokens (unless it meets an EOS).
    eos = [free_runs[0][0], free_runs[1][14]]
    out = _check_batch(target, drafter, rows, max_new_tokens=30, eos_token_id=eos, pad_token_id=95)
    assert out.row_stats[0].new_tokens == 1 and out.row_stats[0].num_rounds == 0
    assert out.sequences[0, -1].item() == 95, "a row that ended early is padded"
    assert out.sequences.shape[1] == left_padded(rows)["input_ids"].shape[1] + max(s.new_tokens for s in out.row_stats)
    for extra in (1, 2, 5, 13):  # the last round of each row drafts only what still fits
        out = _check_batch(target, drafter, rows, max_new_tokens=extra)
        assert [stats.new_tokens for stats in out.row_stats] == [extra] * len(rows)


class _LastTokenIs(StoppingCriteria):
    """Stops a row whose last token is `token` (any batch size)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_rows_stopped_without_an_eos_keep_generating_as_in_plain_generate(fitted_pairs):
    """With no EOS criterion plain generate does not pad a stopped row: it keeps generating it until every row has
    stopped, and so does the batched loop."""
    target, drafter = fitted_pairs("mistral")
    drafter = drafter.with_generation_config(draft_mode="tree")
    rows = _batch_rows()
    free_run = target.generate(rows[0], do_sample=False, max_new_tokens=30)[0, rows[0].shape[1] :].tolist()
    stop = StoppingCriteriaList([_LastTokenIs(free_run[3])])
    out = _check_batch(target, drafter, rows, max_new_tokens=30, stopping_criteria=stop)
    assert out.row_stats[0].new_tokens > 4, "the stopped row was not generated past its stop"


def test_batch_requests_it_cannot_take_fail_before_any_work(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    batch = left_padded(prompts(count=2))
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="draft_mode='tree'"):
            target.generate(**batch, max_new_tokens=5,
                            assistant_model=drafter.with_generation_config(draft_mode="chain"))
        right_padded = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].flip(1))
        with pytest.raises(ValueError, match="padding_side='left'"):
            target.generate(**right_padded, max_new_tokens=5, assistant_model=drafter)
        with pytest.raises(ValueError, match="output_scores"):
            target.generate(**batch, max_new_tokens=5, assistant_model=drafter, return_dict_in_generate=True,
                            output_scores=True)
    finally:
        handle.remove()
    assert not calls


def _batch_samples(target, drafter, rows, temperature):
    """SAMPLES draws of NEW_TOKENS tokens per row of a left-padded batch, and the drafts accepted in all."""
    batch = left_padded(rows)
    width = batch["input_ids"].shape[1]
    samples, accepted = [[] for _ in rows], 0
    torch.manual_seed(0)
    for _ in range(SAMPLES):
        out = target.generate(**batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=NEW_TOKENS, assistant_model=drafter, return_dict_in_generate=True)
        for b in range(len(rows)):
            samples[b].append(out.sequences[b, width:].tolist())
        accepted += sum(out.speculative_stats.acceptance_lengths)
    return samples, accepted


@pytest.mark.parametrize("rule,should_pass", [("exact", True), ("wrong", False)])
def test_batch_sampling_keeps_each_rows_distribution(sampling_setup, monkeypatch, rule, should_pass):
    """Two rows of a batch (the shorter one left-padded), each checked against its own exact marginals; the same
    test fails when the acceptance rule is wrong."""
    target, drafter, prompt = sampling_setup
    drafter = drafter.with_generation_config(draft_mode="tree")
    if rule == "wrong":
        monkeypatch.setattr(acceptance, "accept_sampling", _wrong_accept_sampling)
    temperature = 0.7
    rows = [prompt, torch.tensor([[6, 0, 5]], device=DEVICE)]
    samples, accepted = _batch_samples(target, drafter, rows, temperature)
    assert accepted > SAMPLES // 5, "drafts were rarely accepted: the test would not exercise acceptance"
    p_values = [min(_p_values(row_samples, _exact_marginals(target, row, temperature)))
                for row, row_samples in zip(rows, samples)]
    assert (min(p_values) > ALPHA / (NEW_TOKENS * len(rows))) == should_pass, p_values


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_batched_draft_equals_each_row_drafted_alone(fitted_pairs, family):
    """A batched `DraftSession` drafts, for rows of different lengths, depths and commit sizes, the trees that a
    single-row session drafts for each row alone (three rounds, so specialists catch up over uneven context and the
    round's node slots move)."""
    from transformers_poss.generation.drafting import DraftSession, draft_tree, draft_trees

    target, drafter = fitted_pairs(family)
    rows = prompts(count=3)
    with torch.no_grad():
        outs = [target(row, output_hidden_states=drafter.config.input_feature_layers) for row in rows]
    features = [drafter.target_features(out.hidden_states)[0] for out in outs]
    roots = [out.logits[0, -1].argmax() for out in outs]
    next_tokens = [torch.cat((row[0, 1:], root.reshape(1))) for row, root in zip(rows, roots)]
    # Rounds commit these many positions per row (the rest of each prompt, then what the rows "accepted").
    first = [2, 5, 9]
    chunks = [[(0, n) for n in first], [(n, n + k) for n, k in zip(first, (1, 3, 2))],
              [(n + k, row.shape[1]) for n, k, row in zip(first, (1, 3, 2), rows)]]
    depth_rounds = [[4, 4, 4], [3, 1, 4], [0, 4, 2]]
    alone = [DraftSession(drafter.bind(target)) for _ in rows]
    together = DraftSession(drafter.bind(target), batch_size=len(rows))
    for chunk, depths in zip(chunks, depth_rounds):
        together.commit_rows([f[a:b] for f, (a, b) in zip(features, chunk)],
                             [t[a:b] for t, (a, b) in zip(next_tokens, chunk)])
        roots_now = torch.stack([t[b - 1] for t, (a, b) in zip(next_tokens, chunk)])
        batched = draft_trees(together, roots_now, depths, top_k=3, total_tokens=12)
        together.end_round()
        for session, f, t, (a, b), root, depth, tree in zip(alone, features, next_tokens, chunk, roots_now, depths,
                                                              batched):
            session.commit(f[a:b], t[a:b])
            single = draft_tree(session, root, depth, top_k=3, total_tokens=12)
            session.end_round()
            assert torch.equal(single.tokens, tree.tokens) and torch.equal(single.parents, tree.parents)
            assert torch.equal(single.visible, tree.visible)
            if single.candidates is not None:
                torch.testing.assert_close(single.candidates.scores, tree.candidates.scores, atol=1e-4, rtol=1e-4)
    together.select_rows(torch.tensor([2, 0]))  # rows that leave the batch leave the session
    assert together.batch_size == 2 and together.lengths == [alone[2].lengths[0], alone[0].lengths[0]]


def test_a_padded_single_prompt_streams_and_keeps_scores(fitted_pairs):
    """One prompt is a batch of one in the same loop: left padding, a streamer and per-step scores together, the
    sequences and scores those of plain `generate` (fp32)."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            pass

    target, drafter = fitted_pairs("llama")
    batch = left_padded([prompts(count=1)[0]], pad_token_id=0)
    batch = {k: torch.cat((torch.zeros_like(v[:, :3]), v), dim=1) for k, v in batch.items()}  # 3 slots of padding
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True)
    reference = target.generate(**batch, **kwargs)
    streamer = Recorder()
    out = target.generate(**batch, assistant_model=drafter.with_generation_config(draft_mode="tree"),
                          streamer=streamer, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == out.sequences[0, batch["input_ids"].shape[1]:].tolist()
    assert len(out.scores) == len(reference.scores)
    for mine, theirs in zip(out.scores, reference.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
