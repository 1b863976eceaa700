"""Budgets per device kind: the kind a device computes as, the entry `generate` takes for it, and plain decoding
(plain `generate`'s output) where an entry says speculation does not pay."""

import json
import warnings

import pytest
import torch

from test_batches import _batch_rows, left_padded
from tiny_models import FAMILIES, prompts
from transformers_poss import PosSDrafter, PosSGenerationConfig
from transformers_poss.devices import device_kind
from transformers_poss.generation_config import resolve_budget
from transformers_poss.generation.hook import UntunedDeviceWarning


def _kind(target) -> str:
    return device_kind(target.device, target.dtype)


def test_device_kind_follows_what_torch_dispatches(monkeypatch):
    from transformers_poss import devices

    monkeypatch.setattr(devices, "cpu_capability", lambda: "avx2")
    assert devices.device_kind("cpu", torch.float32) == "cpu:avx2/float32" and not devices.cpu_has_native_bf16()
    monkeypatch.setattr(devices, "cpu_capability", lambda: "avx512")
    kind = devices.device_kind("cpu", torch.bfloat16)
    assert kind in ("cpu:avx512/bfloat16", "cpu:avx512_bf16/bfloat16")
    assert kind.endswith("_bf16/bfloat16") == devices.cpu_has_native_bf16()


def test_entries_apply_per_kind_round_trip_and_are_validated(tmp_path):
    config = PosSGenerationConfig(default_budget={"tree_depth": 2},
                                  device_budgets={"cpu:avx2/float32": {"tree_depth": 1, "max_batch_size": 2}})
    resolved, sources = resolve_budget(config, "cpu:avx2/float32")
    assert sources["tree_depth"] == "tuned for cpu:avx2/float32"
    assert resolved["tree_depth"] == 1 and resolved["max_batch_size"] == 2 and config.default_budget["tree_depth"] == 2
    assert resolve_budget(config, "cuda:X/bfloat16")[0] == config.default_budget
    assert config.plain_reason("cpu:avx2/float32", 2) is None
    assert "batch size 3 is above max_batch_size 2" in config.plain_reason("cpu:avx2/float32", 3)
    assert config.updated(speculation="always").plain_reason("cpu:avx2/float32", 3) is None
    # A setting given for one call applies on every kind: the entries lose it.
    explicit = config.updated(tree_depth=5)
    assert resolve_budget(explicit, "cpu:avx2/float32")[0]["tree_depth"] == 5
    assert resolve_budget(explicit, "cpu:avx2/float32")[0]["max_batch_size"] == 2
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["device_budgets"] == {"cpu:avx2/float32": {"tree_depth": 1, "max_batch_size": 2}}
    assert PosSGenerationConfig.from_pretrained(tmp_path).device_budgets == config.device_budgets
    for bad, message in ((["x"], "must be a dict"), ({"k": {"tree_depth": 0}}, "tree_depth"),
                         ({"k": {"draft_mode": "chain"}}, "must be a dict of"), ({"k": {"max_batch_size": -1}},
                                                                                "max_batch_size")):
        with pytest.raises(ValueError, match=message):
            PosSGenerationConfig(device_budgets=bad).validate()
    with pytest.raises(ValueError, match="speculation"):
        PosSGenerationConfig(speculation="sometimes").validate()


def test_generate_drafts_with_the_entry_of_its_kind_and_warns_once_without_one(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    prompt = prompts()[0]
    with pytest.warns(UntunedDeviceWarning, match="poss tune"):
        out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                              return_dict_in_generate=True)
    assert out.speculative_stats.tree_depth == 4
    tuned = drafter.with_generation_config()
    tuned.generation_config.device_budgets = {_kind(target): {"tree_depth": 2, "tree_total_tokens": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntunedDeviceWarning)
        out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=tuned,
                              return_dict_in_generate=True)
    stats = out.speculative_stats
    assert stats.tree_depth == 2 and max(stats.tree_sizes) <= 3 and stats.plain_reason is None
    assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_above_the_kinds_max_batch_size_generate_decodes_plainly(fitted_pairs, family):
    """The fallback gives plain `generate`'s output (fp32, token for token) and says why; `speculation="always"`
    drafts the same batch; an entry with `max_batch_size=0` decodes even one prompt plainly."""
    target, drafter = fitted_pairs(family)
    view = drafter.with_generation_config(draft_mode="tree")
    view.generation_config.device_budgets = {_kind(target): {"max_batch_size": 2}}
    batch = left_padded(_batch_rows())
    reference = target.generate(**batch, max_new_tokens=16, do_sample=False)
    out = target.generate(**batch, max_new_tokens=16, do_sample=False, assistant_model=view,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert "batch size 3 is above max_batch_size 2" in out.speculative_stats.plain_reason
    assert out.speculative_stats.num_rounds == 0
    forced = target.generate(**batch, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                             assistant_model=view.with_generation_config(speculation="always"))
    assert torch.equal(forced.sequences, reference) and forced.speculative_stats.plain_reason is None
    assert forced.speculative_stats.num_rounds > 0
    view.generation_config.device_budgets = {_kind(target): {"max_batch_size": 0}}
    prompt = prompts()[0]
    single = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=view,
                             return_dict_in_generate=True)
    assert torch.equal(single.sequences, target.generate(prompt, max_new_tokens=16, do_sample=False))
    assert "does not pay" in single.speculative_stats.plain_reason


def test_plain_fallback_keeps_the_sampling_distribution_path(fitted_pairs):
    """Sampling above the limit is transformers' own sampling loop: the same draws as plain `generate` under the same
    seed."""
    target, drafter = fitted_pairs("qwen2")
    view = drafter.with_generation_config(draft_mode="tree", max_batch_size=1)
    batch = left_padded(_batch_rows())
    torch.manual_seed(3)
    reference = target.generate(**batch, max_new_tokens=10, do_sample=True, temperature=0.8)
    torch.manual_seed(3)
    out = target.generate(**batch, max_new_tokens=10, do_sample=True, temperature=0.8, assistant_model=view)
    assert torch.equal(out, reference)


def test_budgets_per_kind_round_trip_with_the_drafter(fitted_pairs, tmp_path):
    _, drafter = fitted_pairs("llama")
    drafter = drafter.with_generation_config()
    drafter.generation_config.device_budgets = {"cpu:avx2/float32": {"tree_depth": 1, "max_batch_size": 0}}
    drafter.save_pretrained(tmp_path)
    loaded = PosSDrafter.from_pretrained(tmp_path)
    assert loaded.generation_config.device_budgets == drafter.generation_config.device_budgets


def test_a_setting_set_by_attribute_wins_over_the_kinds_entry_and_the_stats_say_so(fitted_pairs, tmp_path):
    """Issue 58: `generation_config.tree_depth = 3` is used on a kind whose entry says 2; the entry fills only what the
    user left as loaded; `speculative_stats.budget` names each value's source; saved and reloaded, it drafts alike."""
    target, drafter = fitted_pairs("llama")
    kind = _kind(target)
    drafter = drafter.with_generation_config()  # a copy of the shared fixture's settings
    drafter.generation_config = PosSGenerationConfig.from_dict({
        **drafter.generation_config.to_dict(),
        "device_budgets": {kind: {"tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 5}}})
    assert "set by the user" not in resolve_budget(drafter.generation_config, kind)[1].values()
    prompt = prompts()[0]
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    budget = out.speculative_stats.budget
    assert out.speculative_stats.tree_depth == 2 and budget.device_kind == kind
    assert budget.sources["tree_depth"] == f"tuned for {kind}" and budget.settings["tree_total_tokens"] == 5
    drafter.generation_config.tree_depth = 3  # set by attribute, as transformers users do
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    stats = out.speculative_stats
    assert stats.tree_depth == 3 and stats.budget.sources["tree_depth"] == "set by the user"
    assert stats.budget.settings["tree_top_k"] == 2 and stats.budget.sources["tree_top_k"] == f"tuned for {kind}"
    assert max(stats.tree_sizes) <= 5
    assert stats.summary()["budget"]["tree_depth"] == {"value": 3, "source": "set by the user"}
    assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=12, do_sample=False))
    assert f"tree_depth=3 (set by the user)" in drafter.generation_config.describe_budget([kind])
    drafter.save_pretrained(tmp_path)  # what the user set applies on every kind after a reload too
    loaded = PosSDrafter.from_pretrained(tmp_path)
    resolved, sources = resolve_budget(loaded.generation_config, kind)
    assert sources["tree_top_k"] == f"tuned for {kind}" and (resolved["tree_depth"], resolved["tree_top_k"]) == (3, 2)
    assert loaded.generation_config.device_budgets[kind] == {"tree_top_k": 2, "tree_total_tokens": 5}


def test_with_generation_config_and_attributes_apply_on_every_kind():
    config = PosSGenerationConfig.from_dict({"tree_depth": 6, "device_budgets": {
        "cpu:avx2/float32": {"tree_depth": 5, "lookup_num_tokens": 10}, "cuda:X/bfloat16": {"tree_depth": 4}}})
    view = config.updated(tree_depth=2)
    for kind in ("cpu:avx2/float32", "cuda:X/bfloat16", "cpu:other/float32"):
        resolved, sources = resolve_budget(view, kind)
        assert resolved["tree_depth"] == 2 and sources["tree_depth"] == "set by the user"
    assert resolve_budget(config, "cpu:avx2/float32")[0]["tree_depth"] == 5  # the drafter's own config is untouched
    config.tree_depth = 6  # the same value as saved, set by the user: it still wins over the entries
    assert resolve_budget(config, "cpu:avx2/float32")[0]["tree_depth"] == 6
    assert resolve_budget(config, "cpu:avx2/float32")[0]["lookup_num_tokens"] == 10
    assert resolve_budget(config, "cpu:other/float32")[1]["tree_top_k"] == "the drafter's default"


def test_describe_budget_shows_what_generate_uses_here():
    from transformers_poss.devices import local_device_kinds

    kind = local_device_kinds()[1]  # this machine's CPU in float32
    config = PosSGenerationConfig.from_dict({"tree_depth": 6, "device_budgets": {kind: {"tree_depth": 3}}})
    text = config.describe_budget()
    assert "What generate uses on this machine" in text and f"on {kind}:" in text
    assert f"tree_depth=3 (tuned for {kind})" in text
    assert "[no budget tuned for this kind: poss tune]" in text.split(f"on {local_device_kinds()[0]}:")[1].split("\n")[0]


def test_an_untuned_kind_warns_only_while_the_tree_budget_is_not_the_users(fitted_pairs):
    target, drafter = fitted_pairs("llama")
    prompt = prompts()[0]
    mine = drafter.with_generation_config(tree_depth=2, tree_top_k=2, tree_total_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntunedDeviceWarning)
        out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=mine,
                              return_dict_in_generate=True)
    assert set(out.speculative_stats.budget.sources.values()) == {"set by the user", "the drafter's default"}


def test_resolve_budget_takes_the_users_value_then_the_kinds_entry_then_the_drafters_default():
    config = PosSGenerationConfig(
        tree_top_k=7, default_budget={"tree_depth": 4, "tree_top_k": 3, "lookup_num_tokens": 5},
        device_budgets={"cpu:avx2/float32": {"tree_depth": 2, "tree_top_k": 2, "max_batch_size": 1}})
    budget, sources = resolve_budget(config, "cpu:avx2/float32")
    assert budget == {"tree_depth": 2, "tree_top_k": 7, "tree_total_tokens": 60, "lookup_num_tokens": 5,
                      "max_batch_size": 1}
    assert sources == {"tree_depth": "tuned for cpu:avx2/float32", "tree_top_k": "set by the user",
                       "tree_total_tokens": "the drafter's default", "lookup_num_tokens": "the drafter's default",
                       "max_batch_size": "tuned for cpu:avx2/float32"}
    for kind in ("cuda:X/bfloat16", None):  # no entry: the drafter's default under what the user set
        assert resolve_budget(config, kind)[0] == {**config.default_budget, "tree_top_k": 7}
    config.tree_top_k = None  # a plain setting: unset again, the kind's entry applies again
    assert resolve_budget(config, "cpu:avx2/float32")[1]["tree_top_k"] == "tuned for cpu:avx2/float32"
    assert config.budget["tree_top_k"] is None and config.default_budget["tree_top_k"] == 3  # resolving changes nothing
    with pytest.raises(ValueError, match="default_budget lacks"):
        config.updated(default_budget={"tree_depth": 4})
    with pytest.raises(ValueError, match=r"default_budget.*must be a dict of"):
        PosSGenerationConfig(default_budget={"draft_mode": "chain"})


@pytest.mark.parametrize("name", ["poss2-smollm2-135m-instruct", "single-smollm2-135m-instruct"])
def test_saved_drafters_load_unchanged_and_draft_with_the_same_budget_on_every_kind(name, tmp_path):
    """A `generation_config.json` written before `default_budget` holds the drafter's budget at the top level: loaded,
    it drafts on each kind with the top level overlaid by that kind's entry, as before; saved again and reloaded, the
    same."""
    from transformers_poss.assets import DRAFTERS_DIR

    saved = json.loads((DRAFTERS_DIR / name / "generation_config.json").read_text())
    assert "default_budget" not in saved
    config = PosSGenerationConfig.from_pretrained(DRAFTERS_DIR / name)
    assert all(config.budget[key] is None for key in ("tree_depth", "tree_top_k", "max_batch_size"))
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == saved | {"transformers_version": written["transformers_version"]}  # the same format
    again = PosSGenerationConfig.from_pretrained(tmp_path)
    for kind in [*saved["device_budgets"], "cpu:other/float32"]:
        before = {key: saved[key] for key in ("tree_depth", "tree_top_k", "tree_total_tokens", "lookup_num_tokens",
                                              "max_batch_size")} | saved["device_budgets"].get(kind, {})
        assert resolve_budget(config, kind)[0] == before == resolve_budget(again, kind)[0], kind


def test_printing_shows_what_is_set_without_asking_the_hardware(monkeypatch):
    from transformers_poss import devices, generation_config

    def no_probe(*args):
        raise AssertionError("printing a generation config probes the hardware")

    for module in (devices, generation_config):
        monkeypatch.setattr(module, "local_device_kinds", no_probe)
    monkeypatch.setattr(devices, "cpu_capability", no_probe)
    config = PosSGenerationConfig.from_dict({"tree_depth": 6, "device_budgets": {"cpu:x/float32": {"tree_depth": 3}}})
    config.tree_top_k = 4
    shown = json.loads(repr(config).split(" ", 1)[1])
    assert shown["tree_top_k"] == 4 and shown["tree_depth"] is None and shown["default_budget"]["tree_depth"] == 6
    assert shown["device_budgets"] == {"cpu:x/float32": {"tree_depth": 3}}
