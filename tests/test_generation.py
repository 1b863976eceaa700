"""Lossless greedy generation through `target.generate(..., assistant_model=drafter)`, chain and tree mode."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer

from tiny_models import FAMILIES, fitted_drafter, prompts, tiny_target


def _generate_both(target, drafter, prompt, **kwargs):
    """(plain sequences, speculative sequences, the speculative call's `GenerationStats`)."""
    reference = target.generate(prompt, do_sample=False, **kwargs)
    out = target.generate(prompt, do_sample=False, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    return reference, out.sequences, out.speculative_stats


@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_and_acceptance_paths(fitted_pairs, family, mode):
    target, drafter = fitted_pairs(family)
    drafter.generation_config.draft_mode = mode
    seen = []
    for prompt in prompts(count=4):  # the drafter was fitted on the first three only
        for max_new_tokens in (1, 30):
            reference, speculative, stats = _generate_both(target, drafter, prompt, max_new_tokens=max_new_tokens)
            assert torch.equal(reference, speculative), (family, mode, max_new_tokens)
            seen += stats.acceptance_lengths
    depth = drafter.generation_config.default_budget["tree_depth"]
    assert 0 in seen, "no round rejected every draft"
    assert any(0 < a < depth for a in seen), "no round accepted some drafts"
    assert depth in seen, "no round accepted all drafts"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "budget",
    [dict(tree_depth=4, tree_top_k=3, tree_total_tokens=1), dict(tree_depth=1, tree_top_k=2, tree_total_tokens=8),
     dict(tree_depth=3, tree_top_k=2, tree_total_tokens=500), dict(tree_depth=6, tree_top_k=4, tree_total_tokens=20)],
)
def test_tree_budgets_and_attention_implementations(fitted_pairs, attn, budget):
    target, drafter = fitted_pairs("llama", attn)
    before = drafter.generation_config.budget
    view = drafter.with_generation_config(draft_mode="tree", **budget)  # a budget for these calls only
    for prompt in prompts(count=2):
        reference, speculative, stats = _generate_both(target, view, prompt, max_new_tokens=25)
        assert torch.equal(reference, speculative)
        assert stats.tree_depth == budget["tree_depth"]
        assert max(stats.tree_sizes) <= budget["tree_total_tokens"]
        assert max(stats.acceptance_lengths) <= budget["tree_depth"]
    assert drafter.generation_config.budget == before  # the shared drafter's own settings are untouched


@pytest.mark.parametrize("mode,lookup_tokens", [("tree", 0), ("chain", 0), ("tree", 6)])
def test_eos_inside_accepted_drafts_and_max_length(fitted_pairs, mode, lookup_tokens):
    target, drafter = fitted_pairs("llama")
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_mode, drafter.generation_config.lookup_num_tokens = mode, lookup_tokens
    prompt = prompts()[0]
    if lookup_tokens:  # a prompt the lookup branch can copy from
        prompt = torch.cat((prompt, prompt), dim=1)
    free_run = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1]:]
    stopped_mid_round = False
    for eos in dict.fromkeys(free_run[3:20].tolist()):  # several EOS choices; some fall inside accepted paths
        reference, speculative, stats = _generate_both(target, drafter, prompt, max_new_tokens=30, eos_token_id=eos)
        assert torch.equal(reference, speculative)
        assert speculative[0, -1].item() == eos
        rounds = stats.acceptance_lengths  # none when the prefill's token is the EOS
        stopped_mid_round |= bool(rounds) and rounds[-1] > 0
    assert stopped_mid_round
    for extra in (1, 2, 5, 13):
        reference, speculative, stats = _generate_both(target, drafter, prompt, max_length=prompt.shape[1] + extra)
        assert torch.equal(reference, speculative) and speculative.shape[1] == prompt.shape[1] + extra


@pytest.mark.parametrize("lookup_tokens", [0, 6])
def test_several_eos_ids_and_logits_processors(fitted_pairs, lookup_tokens):
    target, drafter = fitted_pairs("qwen2")
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_mode, drafter.generation_config.lookup_num_tokens = "tree", lookup_tokens
    prompt = prompts()[1]
    if lookup_tokens:  # grafted nodes get their own prefixes through the logits processors
        prompt = torch.cat((prompt, prompt), dim=1)
    free_run = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1]:].tolist()
    eos_ids = [free_run[9], free_run[15]]
    for kwargs in (dict(eos_token_id=eos_ids), dict(repetition_penalty=1.5), dict(min_new_tokens=12, eos_token_id=eos_ids),
                   dict(no_repeat_ngram_size=2)):
        reference, speculative, stats = _generate_both(target, drafter, prompt, max_new_tokens=30, **kwargs)
        assert torch.equal(reference, speculative), kwargs


class _RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_streamer_gets_exactly_the_returned_tokens(fitted_pairs, mode):
    target, drafter = fitted_pairs("mistral")
    drafter.generation_config.draft_mode = mode
    prompt = prompts()[2]
    streamer = _RecordingStreamer()
    out = target.generate(prompt, do_sample=False, max_new_tokens=21, assistant_model=drafter, streamer=streamer,
                          return_dict_in_generate=True)
    assert streamer.ended
    assert streamer.chunks[0] == prompt[0].tolist()
    streamed = [token for chunk in streamer.chunks[1:] for token in chunk]
    assert streamed == out.sequences[0, prompt.shape[1]:].tolist()
    assert out.speculative_stats.new_tokens == len(streamed)


def test_return_dict_with_scores_matches_plain_generate(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    drafter.generation_config.draft_mode = "tree"
    prompt = prompts()[0]
    kwargs = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.2)
    reference = target.generate(prompt, **kwargs)
    speculative = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(reference.sequences, speculative.sequences)
    assert len(speculative.scores) == len(reference.scores) == 12
    for ours, theirs in zip(speculative.scores, reference.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(speculative.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_stop_strings_stop_without_extra_tokens(fitted_pairs):
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    target, drafter = fitted_pairs("llama")
    drafter.generation_config.draft_mode = "tree"
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(string.printable[:96])}, [], unk_token=None))
    backend.decoder = decoders.Fuse()  # one character per token
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt = prompts()[0]
    free_run = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1]:].tolist()
    stop = tokenizer.decode(free_run[12:14])
    reference, speculative, stats = _generate_both(target, drafter, prompt, max_new_tokens=30, stop_strings=[stop],
                                            tokenizer=tokenizer)
    assert torch.equal(reference, speculative)
    text = tokenizer.decode(speculative[0, prompt.shape[1]:])
    assert text.endswith(stop) and text.count(stop) == 1
    assert speculative.shape[1] <= prompt.shape[1] + 14


def test_peft_wrapped_target(fitted_pairs):
    from peft import LoraConfig, get_peft_model

    base, drafter = fitted_pairs("llama")
    target = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))
    target.eval()
    for mode in ("tree", "chain"):
        drafter.generation_config.draft_mode = mode
        for prompt in prompts(count=2):
            reference = target.generate(input_ids=prompt, do_sample=False, max_new_tokens=20)
            speculative = target.generate(input_ids=prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter)
            assert torch.equal(reference, speculative), mode


def test_ordinary_generate_untouched():
    target = tiny_target("llama", seed=3)
    assistant = tiny_target("llama", seed=4)
    prompt = prompts()[1]
    reference = target.generate(prompt, do_sample=False, max_new_tokens=15)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=15, assistant_model=assistant), reference)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=15, prompt_lookup_num_tokens=3), reference)


def test_drafter_follows_target_dtype(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    target_bf16 = copy.deepcopy(target).to(torch.bfloat16)
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_mode = "tree"
    assert drafter.fc.weight.dtype == torch.float32
    target_bf16.generate(prompts()[0], do_sample=False, max_new_tokens=5, assistant_model=drafter)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.fc.weight.device == target_bf16.get_output_embeddings().weight.device


def _lm_head_rows_per_run(target, drafter):
    """For three prompts: rows of each `lm_head` call in a speculative run (checked identical to plain generate),
    with the run's stats."""
    rows = []
    hook = target.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(out[..., 0].numel()))
    try:
        for prompt in prompts(count=3):
            reference = target.generate(prompt, do_sample=False, max_new_tokens=30)
            rows.clear()
            out = target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=drafter,
                                  return_dict_in_generate=True)
            assert torch.equal(reference, out.sequences)
            yield list(rows), out.speculative_stats
    finally:
        hook.remove()


def _drafter_with_own_head(target):
    """A drafter with its own head, so that every `lm_head` call counted is the target's."""
    return fitted_drafter(target, draft_vocab_size=target.config.vocab_size, steps=300, tree_depth=4, tree_top_k=3,
                          tree_total_tokens=12)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3", {"final_logit_softcapping": 2.0})])
def test_verification_projects_only_the_rows_acceptance_visits(monkeypatch, family, overrides):
    """In fp32 on a CPU tree mode projects `lm_head` rows for the accepted path and the next token only, not for
    every tree node (Gemma's final soft-capping applied to them as the model would); the rule is forced, so the
    path is checked on any device."""
    from transformers_poss.generation import verification

    target = tiny_target(family, **overrides)
    monkeypatch.setattr(verification, "keeps_every_tree_row", lambda model: False)  # the CPU fp32 rule, anywhere
    for rows, stats in _lm_head_rows_per_run(target, _drafter_with_own_head(target)):
        # The prefill keeps one row; each round projects one row per accepted draft plus the target's next token.
        assert sum(rows) == 1 + sum(a + 1 for a in stats.acceptance_lengths)
        assert sum(rows) < 1 + sum(stats.tree_sizes)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3", {"final_logit_softcapping": 2.0})])
def test_verification_projecting_every_tree_row_in_one_pass(monkeypatch, family, overrides):
    """In 16-bit or on an accelerator verification keeps every tree node's logits from its forward: one `lm_head`
    pass per round, the same greedy output (checked in fp32 with the rule forced)."""
    from transformers_poss.generation import verification

    target = tiny_target(family, **overrides)
    # fp32 on a CPU: rows are projected as visited; on an accelerator every row is kept.
    assert verification.keeps_every_tree_row(target) == (target.device.type != "cpu")
    assert verification.keeps_every_tree_row(copy.deepcopy(target).to(torch.bfloat16))
    monkeypatch.setattr(verification, "keeps_every_tree_row", lambda model: True)
    for rows, stats in _lm_head_rows_per_run(target, _drafter_with_own_head(target)):
        assert rows == [1] + stats.tree_sizes  # the prefill's last row, then one pass over each round's tree


def test_lookup_continuation_prefers_longer_and_latest_matches():
    from transformers_poss.generation.drafting import lookup_continuation

    seq = torch.tensor([5, 6, 7, 1, 9, 6, 7, 2, 3, 6, 7])
    # The 3-gram (3, 6, 7) never occurred before; the 2-gram (6, 7) last occurred at index 5, followed by 2, 3.
    assert lookup_continuation(seq, 3, 4).tolist() == [2, 3, 6, 7]
    assert lookup_continuation(seq, 3, 1).tolist() == [2]
    seq = torch.tensor([1, 6, 7, 8, 4, 6, 7, 9, 1, 6, 7])
    assert lookup_continuation(seq, 3, 2).tolist() == [8, 4]  # (1, 6, 7) beats the later (6, 7)
    assert lookup_continuation(seq, 2, 2).tolist() == [9, 1]
    assert lookup_continuation(torch.tensor([1, 2, 3, 4]), 3, 5).numel() == 0  # no repeated n-gram
    assert lookup_continuation(torch.tensor([4]), 3, 5).numel() == 0


def test_graft_branch_follows_matching_nodes_and_appends_the_rest():
    from transformers_poss.generation.drafting import DraftTree, graft_branch

    # root(10) -> a(11) -> b(12); root -> c(13)
    parents = torch.tensor([-1, 0, 1, 0])
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    tree = DraftTree(torch.tensor([10, 11, 12, 13]), parents, torch.tensor([0, 1, 2, 1]), visible)
    grafted = graft_branch(tree, torch.tensor([11, 12, 20, 21]))
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 20, 21]
    assert grafted.parents.tolist() == [-1, 0, 1, 0, 2, 4]
    assert grafted.depths.tolist() == [0, 1, 2, 1, 3, 4]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for node in range(6):  # ancestor-or-self, from the parents
        ancestor = node
        while ancestor >= 0:
            expected[node, ancestor] = True
            ancestor = grafted.parents[ancestor].item()
    assert torch.equal(grafted.visible, expected)
    assert graft_branch(tree, torch.tensor([13])) is tree  # already in the tree
    assert graft_branch(tree, torch.tensor([], dtype=torch.long)) is tree
    assert graft_branch(tree, torch.tensor([30])).parents.tolist() == [-1, 0, 1, 0, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_the_lookup_branch(fitted_pairs, family):
    target, drafter = fitted_pairs(family)
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_mode, drafter.generation_config.lookup_num_tokens = "tree", 6
    lookup_accepted = 0
    for prompt in prompts(count=4):
        repetitive = torch.cat((prompt, prompt, prompt), dim=1)  # gives the lookup matches to copy
        for ids in (prompt, repetitive):
            reference, speculative, stats = _generate_both(target, drafter, ids, max_new_tokens=40)
            assert torch.equal(reference, speculative), family
            lookup_accepted += stats.lookup_tokens
            assert max(stats.tree_sizes) <= drafter.generation_config.default_budget["tree_total_tokens"] + 6
    assert lookup_accepted > 0, "no token came from the lookup branch: the test would not exercise it"


@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_fused_target_layers(fitted_pairs, family, mode):
    """A drafter reading two target hidden states (`feature_layers=[1, -1]`, fused) stays lossless and is fed the
    states it was fitted on: it accepts about as much as the last-layer drafter (1.6-3.4 tokens a round; a drafter
    fed other features accepts almost nothing)."""
    target, drafter = fitted_pairs(family, feature_layers=(1, -1))
    drafter.generation_config.draft_mode = mode
    assert drafter.fuse is not None and drafter.fuse.weight.shape == (64, 128)
    seen = []
    for prompt in prompts(count=3):
        reference, speculative, stats = _generate_both(target, drafter, prompt, max_new_tokens=30)
        assert torch.equal(reference, speculative), (family, mode)
        seen += stats.acceptance_lengths
    assert sum(seen) / len(seen) >= 1.2, seen


def test_int8_draft_linear_products_and_fallbacks():
    """An `Int8Linear` product is within quantization error of the exact one, follows weight changes, and is exact
    (the weight itself) with gradients or on more than 32 fp32 rows; it keeps the linear layer's parameters and state,
    and swapping it in and out of a module leaves that module's state as it was."""
    from transformers_poss.kernels import Int8Linear, use_int8_linears

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = Int8Linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.state_dict().keys() == linear.state_dict().keys()
    x, many = torch.randn(1, 3, 64), torch.randn(2, 20, 64)  # fp32: 8-bit products up to 32 rows
    exact = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        approximate = layer(x)
        assert not torch.equal(approximate, exact)
        assert (approximate - exact).abs().max() <= 0.02 * exact.abs().max()
        torch.testing.assert_close(layer(many), torch.nn.functional.linear(many, layer.weight, layer.bias))
        layer.weight.mul_(2)
        torch.testing.assert_close(layer(x) - layer.bias, 2 * (approximate - layer.bias), rtol=0.02, atol=0.02)
        layer.weight.div_(2)
    torch.testing.assert_close(layer(x), exact)  # with gradients: the weight itself
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    use_int8_linears(model, True)
    assert [type(m) for m in model] == [Int8Linear, torch.nn.ReLU, Int8Linear]
    use_int8_linears(model, False)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "eagle3"])
def test_lean_specialist_forward_matches_the_transformers_layers(monkeypatch, family, implementation):
    """Inference runs specialists through `lean_attention` instead of the transformers attention modules, and a draft
    session reads RoPE rows from a table: the same features with and without a cache (weights perturbed away from their
    initial values, so Qwen2's biases and Qwen3's q/k norms count), and the same draft trees."""
    from transformers_poss import PosSDrafter, layers
    from transformers_poss.generation.drafting import DraftSession, draft_tree

    extra = {"num_hidden_layers": 8} if family == "eagle3" else {}
    target = tiny_target("llama" if family == "eagle3" else family, attn_implementation=implementation, **extra)
    extra = {"drafter_type": "eagle3"} if family == "eagle3" else {}
    drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=2, **extra).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    inputs = torch.randn(2, 9, drafter.layer_input_size, generator=generator)
    positions = torch.arange(3, 12).expand(2, -1)
    context = torch.randint(0, 96, (1, 20), generator=generator)

    def outputs():
        with torch.no_grad():
            cache = DynamicCache()
            first = drafter.run_specialist(1, inputs[:, :6], positions[:, :6], cache=cache)
            rest = drafter.run_specialist(1, inputs[:, 6:], positions[:, 6:], cache=cache)
            session = DraftSession(drafter.bind(target))
            width = drafter.config.hidden_size * len(drafter.config.input_feature_layers)
            features = torch.randn(19, width, generator=torch.Generator().manual_seed(1))
            session.commit(features, context[0, 1:])
            tree = draft_tree(session, context[0, -1], depth=4, top_k=3, total_tokens=31)  # all 4 levels
        return drafter.run_specialist(0, inputs, positions), torch.cat((first, rest), dim=1), tree

    calls = []
    lean = layers.lean_attention
    monkeypatch.setattr(layers, "lean_attention", lambda *args: calls.append(1) or lean(*args))
    fast = outputs()
    assert len(calls) >= 6 and drafter.rope.table is not None  # the session's RoPE rows came from the table
    table, computed = drafter.rope.rows(inputs, positions, 40), drafter.rotary_emb(inputs, positions)
    for read, made in zip(table, computed):
        torch.testing.assert_close(read, made, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(layers, "runs_lean", lambda attention: False)
    monkeypatch.setattr(drafter.rope, "table_allowed", False)
    reference = outputs()
    torch.testing.assert_close(fast[0], reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[1], reference[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(fast[2].tokens, reference[2].tokens) and torch.equal(fast[2].parents, reference[2].parents)
    torch.testing.assert_close(fast[2].candidates.scores, reference[2].candidates.scores, rtol=1e-5, atol=1e-5)


def _int8_view(drafter, **settings):
    """A copy of `drafter` that drafts on 8-bit weight copies, with other generation settings."""
    int8 = copy.deepcopy(drafter)
    int8.int8_draft_weights = True
    return int8.with_generation_config(**settings)


@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_identity_with_int8_draft_weights(fitted_pairs, monkeypatch, family, mode):
    """Drafting on 8-bit weight copies (the layers and the mapped draft-head rows) keeps the output identical to
    plain generate, still accepts drafts, and leaves the drafter as it was after the call."""
    from transformers_poss import kernels

    target, drafter = fitted_pairs(family)
    products = []
    product = kernels.int8_product
    monkeypatch.setattr(kernels, "int8_product", lambda *args: products.append(1) or product(*args))
    view = _int8_view(drafter, draft_mode=mode)
    accepted = []
    for prompt in prompts(count=3):
        reference, speculative, stats = _generate_both(target, view, prompt, max_new_tokens=30)
        assert torch.equal(reference, speculative), (family, mode)
        accepted += stats.acceptance_lengths
    assert products, "no 8-bit product ran"
    assert sum(accepted) / len(accepted) >= 0.5, accepted
    assert not drafter.int8_draft_weights


def test_int8_draft_weights_on_mapped_head_rows(monkeypatch):
    """With a draft head that maps most rows from the target's `lm_head`, 8-bit logits of a 4-row frontier stay within
    quantization error of the exact ones, and the mapped rows themselves were multiplied on 8 bits."""
    from transformers_poss import PosSDrafter, kernels

    target = tiny_target("llama")
    torch.manual_seed(0)
    drafter = PosSDrafter.from_target(target, draft_vocab_size=64, draft_head_rows=16)
    bound = drafter.bind(target)
    bound.init_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    torch.nn.init.normal_(drafter.draft_head_map.weight)
    features = torch.randn(4, target.config.hidden_size)  # a top-k 4 frontier
    products = []
    product = kernels.int8_product
    monkeypatch.setattr(kernels, "int8_product", lambda x, values, scales: products.append(values.shape[0]) or product(x, values, scales))
    with torch.no_grad():
        exact = bound.logits(features)
        drafter.int8_draft_weights = True
        approximate = bound.logits(features)
        assert approximate.shape == exact.shape
        assert (approximate - exact).abs().max() <= 0.03 * exact.abs().max()
        assert not torch.equal(approximate, exact)
        drafter.int8_draft_weights = False
        torch.testing.assert_close(bound.logits(features), exact)
    assert 48 in products  # the 48 mapped rows


def test_generate_reuses_the_mapped_head_rows_of_the_same_target():
    """`generate` binds the drafter on every call; the draft-head rows gathered from the target's `lm_head` and their
    8-bit copy are made once per target (re-gathering and re-packing them cost tens of ms per call), and gathered
    again for another target or a changed `lm_head` weight."""
    from transformers_poss import PosSDrafter

    target = tiny_target("llama")
    torch.manual_seed(0)
    drafter = PosSDrafter.from_target(target, draft_vocab_size=64, draft_head_rows=16)
    drafter.bind(target).init_draft_vocab(torch.randperm(target.config.vocab_size)[:64])
    drafter.int8_draft_weights = True
    view = drafter.with_generation_config(tree_depth=2, tree_top_k=2, tree_total_tokens=4)
    prompt = prompts(count=1)[0]
    with torch.no_grad():
        target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                        assistant_model=view)
        bound = drafter.bind(target)
        rows, packed = bound.mapped_head_rows(), bound.mapped_head_rows(int8=True)
        for assistant in (view, drafter.with_generation_config()):
            target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                            assistant_model=assistant)
    assert bound.mapped_head_rows() is rows and drafter.bind(target).mapped_head_rows(int8=True) is packed
    assert view.bind(target).mapped_head_rows() is rows  # one cache for the drafter and its views
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(2)
    assert torch.equal(bound.mapped_head_rows(), 2 * rows)
    other = tiny_target("llama")
    bound = drafter.bind(other)
    expected = other.get_output_embeddings().weight[drafter.draft_to_target[16:]]
    assert torch.equal(bound.mapped_head_rows(), expected.to(rows.dtype))
