"""PosSConfig / PosSDrafter: validation, save/load, Auto classes, the tree mask, and errors before any work."""

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel
from transformers.cache_utils import DynamicCache

from tiny_models import DEVICE, distinct_adapters, prompts, tiny_target
from transformers_poss import PosSConfig, PosSDrafter, PosSGenerationConfig
from transformers_poss.generation import hook
from transformers_poss.generation.drafting import DraftSession, draft_chain, draft_tree
from transformers_poss.generation.verification import tree_attention_mask


def _ids(*rows: list[int]) -> torch.LongTensor:
    """Token ids `[len(rows), n]` on the tiny models' device."""
    return torch.tensor(rows, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize("bad", [dict(num_specialists=0), dict(positions_per_specialist=-1), dict(num_specialists=1.5)])
def test_config_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PosSConfig(**bad)


@pytest.mark.parametrize(
    "bad", [dict(tree_depth=0), dict(tree_top_k=0), dict(tree_total_tokens=0), dict(draft_mode="beam"),
            dict(lookup_num_tokens=-1), dict(lookup_ngram_size=1)],
)
def test_generation_config_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PosSGenerationConfig(**bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        PosSGenerationConfig().updated(**bad)


def test_budget_in_config_is_refused_with_where_it_went():
    with pytest.raises(ValueError, match="generation_config"):
        PosSConfig(tree_depth=4)
    with pytest.raises(ValueError, match="Unknown drafting settings"):
        PosSDrafter.from_target(tiny_target("llama")).with_generation_config(tree_dpeth=4)


@pytest.mark.parametrize("setting", [dict(top_k=4), dict(temperature=0.5), dict(max_new_tokens=9)])
def test_drafting_views_refuse_generate_settings_and_point_to_generate(setting):
    drafter = PosSDrafter.from_target(tiny_target("llama"))
    name = next(iter(setting))
    with pytest.raises(ValueError, match=rf"settings of generate\(\).*target\.generate\(\.\.\., {name}="):
        drafter.with_generation_config(**setting)
    with pytest.raises(ValueError, match="deep_draft_vocab"):  # a removed option is just unknown now
        drafter.with_generation_config(deep_draft_vocab=8)


def test_config_rejects_unknown_family():
    with pytest.raises(ValueError, match="gpt2"):
        PosSConfig(target_config={"model_type": "gpt2", "hidden_size": 8, "vocab_size": 8,
                                  "num_attention_heads": 2, "intermediate_size": 8})


def test_specialist_for_position():
    config = PosSConfig(num_specialists=3, positions_per_specialist=2)
    assert [config.specialist_for_position(p) for p in range(1, 10)] == [0, 0, 1, 1, 2, 2, 2, 2, 2]
    single = PosSConfig(num_specialists=1, positions_per_specialist=1)
    assert {single.specialist_for_position(p) for p in range(1, 8)} == {0}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_save_load_round_trip_and_auto_model(tmp_path, family):
    target = tiny_target(family)
    drafter = PosSDrafter.from_target(target, num_specialists=3, positions_per_specialist=2, tree_top_k=4)
    drafter.training_record = {"steps": 7}
    drafter.save_pretrained(tmp_path)
    saved = {p.name for p in tmp_path.iterdir()}
    # no card on save, no empty tuning record; the budget is not in config.json
    assert saved == {"model.safetensors", "config.json", "generation_config.json", "training_record.json",
                     "custom_generate"}
    assert "tree_top_k" not in (tmp_path / "config.json").read_text()
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "model.safetensors").keys()
    assert not any("embed" in k or "lm_head" in k for k in keys), keys
    assert all(k.split(".")[0] in {"fc", "specialists"} for k in keys)
    assert not any("input_layernorm" in k for k in keys)
    for loaded in (PosSDrafter.from_pretrained(tmp_path), AutoModel.from_pretrained(tmp_path)):
        assert type(loaded) is PosSDrafter
        strip = lambda config: {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}  # noqa: E731
        assert strip(loaded.config) == strip(drafter.config)
        assert loaded.generation_config.budget == drafter.generation_config.budget
        assert loaded.generation_config.default_budget["tree_top_k"] == 4
        assert isinstance(loaded.generation_config, PosSGenerationConfig)
        assert loaded.training_record == {"steps": 7} and loaded.tuning_record == {}
        for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(a.cpu(), b.cpu()), name
    assert isinstance(AutoConfig.from_pretrained(tmp_path), PosSConfig)
    # The reloaded drafter predicts exactly what the original does once bound.
    loaded = PosSDrafter.from_pretrained(tmp_path).bind(target)
    ids, feats = torch.randint(0, 96, (1, 6), device=DEVICE), torch.randn(1, 6, 64, device=DEVICE)
    for specialist in range(3):
        torch.testing.assert_close(loaded(ids, feats, specialist=specialist).features,
                                   drafter.bind(target)(ids, feats, specialist=specialist).features, rtol=0, atol=0)


def test_unbound_drafter_says_how_to_bind(tmp_path):
    drafter = PosSDrafter.from_target(tiny_target("llama"))
    drafter.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"drafter\.bind\(target\)"):
        PosSDrafter.from_pretrained(tmp_path)(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 64))


class _ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


@pytest.mark.parametrize(
    "other,match",
    [(dict(hidden_size=32, intermediate_size=64), "hidden_size=64.*hidden_size=32"),
     (dict(vocab_size=50), "vocab_size=96.*vocab_size=50")],
)
def test_mismatched_drafter_fails_before_any_work(other, match):
    drafter = PosSDrafter.from_target(tiny_target("llama"))
    target = tiny_target("llama", **other) if "vocab_size" not in other else tiny_target("llama", vocab_size=50)
    counter = _ForwardCounter(target)
    with pytest.raises(ValueError, match=match):
        target.generate(_ids([1, 2, 3]), max_new_tokens=5, assistant_model=drafter)
    assert counter.calls == 0


def test_drafter_for_another_family_fails():
    drafter = PosSDrafter.from_target(tiny_target("llama"))
    target = tiny_target("qwen2")
    with pytest.raises(ValueError, match="'llama'.*'qwen2'"):
        target.generate(_ids([1, 2, 3]), max_new_tokens=5, assistant_model=drafter)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(num_beams=2), "num_beams=2"), (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
     (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
     (dict(cache_implementation="static"), "cache_implementation")],
)
def test_unsupported_generate_options_fail_before_any_work(kwargs, match):
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target)
    counter = _ForwardCounter(target)
    with pytest.raises(ValueError, match=match):
        target.generate(_ids([1, 2, 3]), max_new_tokens=5, assistant_model=drafter, **kwargs)
    assert counter.calls == 0


def test_chain_mode_batch_and_padding_fail_before_any_work():
    """Chain mode verifies one unpadded prompt; batches and padded prompts are refused, naming tree mode (which
    takes them: tests/test_batches.py)."""
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target).with_generation_config(draft_mode="chain")
    counter = _ForwardCounter(target)
    with pytest.raises(ValueError, match="draft_mode='tree'"):
        target.generate(_ids([1, 2, 3], [4, 5, 6]), max_new_tokens=5, assistant_model=drafter)
    with pytest.raises(ValueError, match="draft_mode='tree'"):
        target.generate(_ids([0, 2, 3]), attention_mask=_ids([0, 1, 1]), max_new_tokens=5,
                        assistant_model=drafter)
    assert counter.calls == 0


def test_unknown_draft_mode_set_after_loading_fails():
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target)
    drafter.generation_config.draft_mode = "beam"
    with pytest.raises(ValueError, match="draft_mode"):
        target.generate(_ids([1, 2, 3]), max_new_tokens=5, assistant_model=drafter)


def test_sliding_window_target_beyond_window_is_refused():
    target = tiny_target("gemma3")
    drafter = PosSDrafter.from_target(target)
    with pytest.raises(ValueError, match="sliding-window"):
        target.generate(_ids([1, 2, 3]), max_new_tokens=300, assistant_model=drafter)


def test_unsupported_transformers_version_fails_at_import_check(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "4.57.0")
    with pytest.raises(ImportError, match="supports transformers >=5.24"):
        hook.check_transformers_version()


SHAPES = {"poss-1": {"num_specialists": 2, "positions_per_specialist": 1},
          "groups-1-1-2": {"num_specialists": 3, "position_groups": [1, 1, 2]},
          "lora-groups-1-1-2": {"num_specialists": 3, "position_groups": [1, 1, 2], "lora_rank": 4}}


@pytest.mark.parametrize("family,shape", [("llama", "poss-1"), ("gemma3", "poss-1"), ("llama", "groups-1-1-2"),
                                          ("qwen2", "lora-groups-1-1-2")])
def test_tree_candidates_score_what_their_path_scores_as_a_chain(family, shape):
    """Every scored tree candidate's cumulative log-probability equals the sum over its root path drafted as a chain:
    the tree feeds each node its parent's predicted feature, position and ancestors as a one-path draft does, with
    the same specialist at each level."""
    target = tiny_target(family)
    torch.manual_seed(0)
    drafter = distinct_adapters(PosSDrafter.from_target(target, **SHAPES[shape]), std=0.2).eval().bind(target)
    prompt = prompts(target.config.vocab_size, 1)[0]
    with torch.no_grad():
        out = target(prompt, output_hidden_states=-1)
    root = out.logits[0, -1].argmax()
    session = DraftSession(drafter)
    session.commit(out.hidden_states[-1][0], torch.cat((prompt[0, 1:], root.reshape(1))))
    candidates = draft_tree(session, root, depth=3, top_k=3, total_tokens=40).candidates
    session.end_round()
    parents = candidates.parents.tolist()
    assert len(parents) == 3 + 9 + 9 and candidates.depths.max() == 3
    for node in range(len(parents)):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        forced = [candidates.tokens[i] for i in path]
        total = []

        def pick(level, logits):
            total.append(torch.log_softmax(logits, dim=-1)[forced[level - 1]])
            return forced[level - 1], logits

        draft_chain(session, len(path), pick)
        session.end_round()
        torch.testing.assert_close(sum(total), candidates.scores[node], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("gemma3", "eager"),
                                         ("qwen2", "sdpa"), ("mistral", "eager")])
def test_tree_mask_matches_running_each_path(fitted_pairs, family, attn):
    """Target logits at every tree node equal the logits of that node's root-to-node path run as a plain sequence."""
    target, drafter = fitted_pairs(family, attn)
    drafter = copy.deepcopy(drafter).bind(target)
    for prompt, (depth, top_k, total) in zip(prompts(), [(3, 2, 7), (4, 3, 12), (2, 4, 9)]):
        with torch.no_grad():
            out = target(prompt, output_hidden_states=-1)
        session = DraftSession(drafter)
        root = out.logits[0, -1].argmax()
        session.commit(out.hidden_states[-1][0], torch.cat((prompt[0, 1:], root.reshape(1))))
        tree = draft_tree(session, root, depth, top_k, total)
        assert len(tree) == total
        sequence = torch.cat((prompt, root.reshape(1, 1)), dim=1)
        cache = DynamicCache(config=target.config)
        past = sequence.shape[1] - 1
        with torch.no_grad():
            target(sequence[:, :-1], cache=cache, use_cache=True)
            mask = tree_attention_mask(target, tree, past, DEVICE)
            tree_logits = target(tree.tokens[None], position_ids=(past + tree.depths)[None], cache=cache,
                                 attention_mask=mask, use_cache=True).logits[0]
        parents = tree.parents.tolist()
        for node in range(len(tree)):
            path, cursor = [], node
            while cursor > 0:
                path.append(int(tree.tokens[cursor]))
                cursor = parents[cursor]
            plain = torch.cat((sequence, _ids(path[::-1])), dim=1)
            with torch.no_grad():
                expected = target(plain).logits[0, -1]
            torch.testing.assert_close(tree_logits[node], expected, atol=1e-4, rtol=1e-4)  # fp32 tolerance


def test_a_budget_in_config_json_is_refused_with_where_it_goes(tmp_path):
    """Drafting settings live in generation_config.json; a config.json that holds them is refused, not half-read."""
    import json

    drafter = PosSDrafter.from_target(tiny_target("llama"), num_specialists=2, positions_per_specialist=2)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tree_depth": 3}))
    with pytest.raises(ValueError, match=r"\['tree_depth'\] are drafting settings.*generation_config"):
        PosSDrafter.from_pretrained(tmp_path)


def test_per_call_settings_leave_the_shared_drafter_alone():
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, tree_depth=2, tree_top_k=2, tree_total_tokens=4)
    view = drafter.with_generation_config(tree_depth=5, draft_mode="chain")
    assert (view.generation_config.tree_depth, view.generation_config.draft_mode) == (5, "chain")
    assert (drafter.generation_config.default_budget["tree_depth"], drafter.generation_config.draft_mode) == (2, "tree")
    assert view.fc.weight is drafter.fc.weight  # the same weights, not a copy
    out = target.generate(prompts(count=1)[0], max_new_tokens=8, do_sample=False, assistant_model=view,
                          return_dict_in_generate=True)
    stats = out.speculative_stats
    assert stats.draft_mode == "chain" and stats.tree_depth == 5 and stats.num_rounds > 0
    assert not hasattr(drafter, "last_generation_stats")  # results travel on the output only
    out = target.generate(prompts(count=1)[0], max_new_tokens=8, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert out.speculative_stats.draft_mode == "tree" and out.speculative_stats.tree_depth == 2
    summary = out.speculative_stats.summary()
    assert summary["rounds"] == out.speculative_stats.num_rounds and len(summary["position_acceptance"]) == 2
