"""The poss_vllm plugin's plain-Python parts, without vLLM: the position -> specialist map (uniform and uneven groups),
the batch-size schedule an export suggests and the plugin applies, the engine-mode refusals, and the interface check
(`poss_vllm.interfaces`) on small fake vLLM trees. tests_vllm/ runs the real engine and checks vLLM 0.33.0's sources
(`test_vllm_interfaces.py`, which fetches its wheel)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "integrations" / "vllm"


@pytest.fixture
def plugin(monkeypatch):
    """The poss_vllm package from the working tree (fresh modules each test)."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    for name in [m for m in sys.modules if m == "poss_vllm" or m.startswith("poss_vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    import poss_vllm
    import poss_vllm.config
    import poss_vllm.interfaces

    return poss_vllm


# ---- position -> specialist ---------------------------------------------------------------------------------------
def test_uniform_groups_map_positions_as_the_library_does(plugin):
    from poss_vllm.config import position_groups, specialist_for_position

    for n in (1, 2, 3, 4):
        for k in (1, 2, 3):
            groups = position_groups({"num_specialists": n, "positions_per_specialist": k})
            assert groups == [k] * n
            for position in range(1, 16):
                assert specialist_for_position(position, groups) == min((position - 1) // k, n - 1)


def test_uneven_groups_from_the_poss_block(plugin):
    from poss_vllm import PosSServingError
    from poss_vllm.config import check_poss_block, position_groups, specialist_for_position

    poss = {"format": "poss-vllm", "format_version": 1, "drafter_type": "eagle3", "num_specialists": 3,
            "position_groups": [1, 3, 4], "target": {}}
    check_poss_block(poss, "eagle3")  # no positions_per_specialist needed with groups
    groups = position_groups(poss)
    assert [specialist_for_position(p, groups) for p in range(1, 11)] == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    for bad in ([1, 3], [1, 0, 4], "1,3,4", [1, 3.0, 4]):
        with pytest.raises(PosSServingError, match="position_groups"):
            check_poss_block({**poss, "position_groups": bad}, "eagle3")
    with pytest.raises(ValueError):
        specialist_for_position(0, groups)


# ---- the batch-size schedule --------------------------------------------------------------------------------------
def _export_config(tmp_path: Path, max_batch_size: int | None, k: int = 2) -> Path:
    folder = tmp_path / "export"
    folder.mkdir()
    suggestion = {"num_speculative_tokens": k}
    if max_batch_size is not None:
        suggestion["max_batch_size"] = max_batch_size
    config = {"speculators_config": {"proposal_methods": [{"speculative_tokens": k}]},
              "poss": {"format": "poss-vllm", "drafter_type": "eagle", "speculative_config": suggestion}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_batch_schedule_and_vllms_expansion_of_it(plugin):
    from poss_vllm.config import batch_schedule

    assert batch_schedule(2, 3) == [[1, 2, 3], [3, 3, 0]]
    assert batch_schedule(0, 3) == [[1, 1, 0]]

    def dense(schedule, max_seqs, k):  # vllm/v1/spec_decode/dynamic/utils.py build_dynamic_sd_schedule_lookup, 0.32
        table = [0] * (max_seqs + 1)
        last = None
        for start, end, value in schedule:
            for size in range(start, min(end, max_seqs) + 1):
                table[size] = min(k, value)
            last = value
        for size in range(schedule[-1][1] + 1, max_seqs + 1):
            table[size] = min(k, last)
        return table[1:]

    assert dense(batch_schedule(2, 3), 8, 3) == [3, 3, 0, 0, 0, 0, 0, 0]
    assert dense(batch_schedule(0, 3), 4, 3) == [0, 0, 0, 0]


def test_the_plugin_applies_the_exports_schedule_unless_the_user_sets_one(plugin, tmp_path):
    from poss_vllm.config import speculative_config, with_export_schedule

    folder = _export_config(tmp_path, max_batch_size=2)
    asked = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3}
    applied = with_export_schedule(asked, asked)
    assert applied["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 3, 0]]
    assert "num_speculative_tokens_per_batch_size" not in asked  # a copy
    # `vllm serve EXPORT`: vLLM's own dict (K from the export), no user dict
    served = with_export_schedule({"method": "eagle", "model": str(folder), "num_speculative_tokens": 2}, None)
    assert served["num_speculative_tokens_per_batch_size"] == [[1, 2, 2], [3, 3, 0]]
    own = {**asked, "num_speculative_tokens_per_batch_size": None}  # the user's choice (none) stands
    assert with_export_schedule(own, own) == own
    assert with_export_schedule({"method": "ngram", "num_speculative_tokens": 3}, None) == {
        "method": "ngram", "num_speculative_tokens": 3}
    (tmp_path / "untuned").mkdir()
    untuned = _export_config(tmp_path / "untuned", max_batch_size=None)
    plain = {"method": "eagle", "model": str(untuned), "num_speculative_tokens": 3}
    assert with_export_schedule(plain, plain) == plain
    assert speculative_config(folder) == {"method": "eagle", "model": str(folder), "num_speculative_tokens": 2,
                                          "num_speculative_tokens_per_batch_size": [[1, 2, 2], [3, 3, 0]]}
    assert speculative_config(folder, 4, num_speculative_tokens_per_batch_size=None) == {
        "method": "eagle", "model": str(folder), "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": None}
    assert plugin.speculative_config(folder)["num_speculative_tokens"] == 2


def test_the_wrapped_speculators_override_passes_the_users_dict_through(plugin, tmp_path):
    from poss_vllm.config import _wrap_speculators_override

    folder = _export_config(tmp_path, max_batch_size=1)

    def original(model, tokenizer, trust_remote_code, revision=None, vllm_speculative_config=None, hf_token=None):
        return model, tokenizer, vllm_speculative_config

    wrapped = _wrap_speculators_override(original)
    user = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 2}
    model, _, speculative = wrapped(model="target", tokenizer=None, trust_remote_code=False,
                                    vllm_speculative_config=user)
    assert model == "target" and speculative["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 2, 0]]
    assert wrapped("target", None, False, None, None)[2] is None


def test_the_export_suggests_the_shipped_drafters_max_batch_size(tmp_path):
    from transformers_poss import PosSDrafter
    from transformers_poss.assets import default_drafter_path
    from transformers_poss.checkpoints.export import vllm_speculative_config

    drafter = PosSDrafter.from_pretrained(default_drafter_path("poss2"))
    budgets = drafter.generation_config.device_budgets
    limit = min(entry["max_batch_size"] for kind, entry in budgets.items()
                if "max_batch_size" in entry and kind.endswith("/bfloat16"))  # the kinds engines serve in
    k = drafter.generation_config.default_budget["tree_depth"]
    suggestion = vllm_speculative_config(drafter)
    assert suggestion["num_speculative_tokens"] == k and suggestion["max_batch_size"] == limit
    assert suggestion["num_speculative_tokens_per_batch_size"] == [[1, limit, k], [limit + 1, limit + 1, 0]]
    assert set(suggestion["max_batch_size_by_device_kind"]) == {kind for kind, entry in budgets.items()
                                                                if "max_batch_size" in entry}
    drafter.generation_config.device_budgets = {"cpu:x/float32": {"max_batch_size": 0},
                                                "cpu:x/bfloat16": {"max_batch_size": 4}}
    assert vllm_speculative_config(drafter)["max_batch_size"] == 4  # an fp32 kind does not decide for engines
    drafter.generation_config.device_budgets, drafter.generation_config.max_batch_size = {}, None
    assert "num_speculative_tokens_per_batch_size" not in vllm_speculative_config(drafter)
    drafter.generation_config.max_batch_size = 0  # never pays: no drafting at any batch size
    assert vllm_speculative_config(drafter)["num_speculative_tokens_per_batch_size"] == [[1, 1, 0]]


# ---- engine modes -------------------------------------------------------------------------------------------------
def _vllm_config(v2=False, mode="NONE", eager=None):
    return SimpleNamespace(use_v2_model_runner=v2, compilation_config=SimpleNamespace(
        cudagraph_mode=SimpleNamespace(name=mode)), speculative_config=SimpleNamespace(enforce_eager=eager))


def test_engine_modes_that_would_lose_the_draft_index_are_refused(plugin):
    from poss_vllm import PosSServingError
    from poss_vllm.config import check_engine_mode

    check_engine_mode(_vllm_config(), breakable_graphs=False)  # the CPU build
    check_engine_mode(_vllm_config(mode="FULL_AND_PIECEWISE"), breakable_graphs=False)  # GPU default: eager drafter
    check_engine_mode(_vllm_config(mode="PIECEWISE", eager=True), breakable_graphs=True)
    with pytest.raises(PosSServingError, match="Model Runner V2"):
        check_engine_mode(_vllm_config(v2=True), breakable_graphs=False)
    with pytest.raises(PosSServingError, match="enforce_eager"):
        check_engine_mode(_vllm_config(mode="PIECEWISE"), breakable_graphs=True)


def test_reading_an_export_selects_the_v1_runner(plugin, monkeypatch):
    from poss_vllm import PosSServingError
    from poss_vllm.config import choose_v1_runner

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    choose_v1_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(PosSServingError, match="V1 model runner"):
        choose_v1_runner()


# ---- the interface check ------------------------------------------------------------------------------------------
FAKE_VLLM = {
    "vllm/__init__.py": "from .version import __version__\nimport typing\nif typing.TYPE_CHECKING:\n"
                        "    from vllm.model_executor.models import ModelRegistry\n",
    "vllm/version.py": "try:\n    from ._version import __version__\nexcept Exception:\n    __version__ = 'dev'\n",
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/models/__init__.py": "from .registry import ModelRegistry\n",
    "vllm/model_executor/models/registry.py": (
        "class _ModelRegistry:\n    def register_model(self, model_arch, model_cls):\n        pass\n"
        "ModelRegistry = _ModelRegistry()\n"),
    "vllm/proposer.py": (
        "class Base:\n    def __init__(self):\n        self.model = None\n"
        "class Proposer(Base):\n"
        "    def build(self, common_attn_metadata, draft_index: int = 0):\n        pass\n"
        "    def propose(self):\n        self.build(1)\n        for i in range(3):\n"
        "            self.build(1, draft_index=i + 1)\n        kwargs = {'input_ids': 1}\n"),
}


def _tree(plugin, files):
    return plugin.interfaces.SourceTree(files.get, "fake")


def test_the_interface_check_on_fake_trees(plugin):
    from poss_vllm.interfaces import Call, Member, Symbol, Uses, check

    needs = (
        Symbol("vllm", "__version__", "version"),
        Symbol("vllm", "ModelRegistry.register_model", "registry", Call(2)),
        Symbol("vllm.proposer", "Proposer.build", "wrapped", Call(1, ("draft_index",))),
        Member("vllm.proposer", "Proposer", ("model", "propose"), "inherited instance attribute"),
        Uses("vllm.proposer", "Proposer.propose", "call site", calls=(("build", ("draft_index",)),),
             strings=("input_ids",)),
    )
    tree = _tree(plugin, FAKE_VLLM)
    assert tree.version() == "9.9.9"
    findings = check(tree, needs)
    assert all(f.ok for f in findings), [f.line() for f in findings]
    broken = {**FAKE_VLLM, "vllm/proposer.py": FAKE_VLLM["vllm/proposer.py"]
              .replace("draft_index: int = 0", "step: int = 0").replace("draft_index=i + 1", "step=i + 1")
              .replace("self.model = None", "self.net = None").replace("'input_ids'", "'ids'")}
    findings = check(_tree(plugin, broken), needs)
    failed = {f.need.label: f.detail for f in findings if not f.ok}
    assert "has no keyword parameter 'draft_index'" in failed["vllm.proposer.Proposer.build"]
    assert "missing ['model']" in failed["vllm.proposer.Proposer: model, propose"]
    uses = next(detail for label, detail in failed.items() if label.startswith("vllm.proposer.Proposer.propose"))
    assert "no call to build with keywords ['draft_index']" in uses and "no 'input_ids'" in uses
    gone = {k: v for k, v in FAKE_VLLM.items() if "registry" not in k}
    assert [f.ok for f in check(_tree(plugin, gone), needs)][:2] == [True, False]
    two_required = {**FAKE_VLLM, "vllm/model_executor/models/registry.py": FAKE_VLLM[
        "vllm/model_executor/models/registry.py"].replace("model_cls)", "model_cls, extra)")}
    assert "requires ['extra']" in check(_tree(plugin, two_required), needs)[1].detail


def test_every_vllm_import_of_the_plugin_is_a_checked_symbol(plugin):
    from poss_vllm.interfaces import RELIED_ON, Symbol, plugin_imports

    symbols = {(need.module, need.name.split(".")[0]) for need in RELIED_ON if isinstance(need, Symbol)}
    imported = plugin_imports(PLUGIN / "poss_vllm")
    assert len(imported) >= 10 and set(imported) <= symbols, sorted(set(imported) - symbols)
