"""The recipe at scale, run end to end at tiny size through the commands a user runs: a server answers the prompts
(`poss distill --server`), then `poss features`, `poss train`, `poss tune` and `poss card`; the drafter it gives
drafts losslessly. On a cluster only the numbers change (the server is `vllm serve`, the target a real one)."""

from __future__ import annotations

import json

import torch

from openai_server import FakeOpenAIServer
from test_training import SMOLLM2_TEMPLATE, fresh_accelerate, make_tokenizer  # noqa: F401 (a fixture)
from tiny_models import tiny_target
from transformers_poss import PosSDrafter
from transformers_poss.devices import device_kind


def test_served_distillation_features_training_tuning_and_card(tmp_path, capsys, fresh_accelerate):  # noqa: F811
    from transformers_poss.cli import main

    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    target = tiny_target("llama", vocab_size=len(tokenizer))
    folder = str(tmp_path / "target")
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    words = lambda n: " ".join(f"u{int(i)}" for i in torch.randint(0, 30, (n,), generator=generator))  # noqa: E731
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "conversations": [{"from": "human", "value": words(4)}]})
                               + "\n" for i in range(12)))
    distilled, features, run = tmp_path / "distilled.jsonl", tmp_path / "features", tmp_path / "run"

    # 1. The served target answers the prompts (vllm serve TARGET on a cluster).
    with FakeOpenAIServer(target, tokenizer) as server:
        assert main(["distill", "--target", folder, "--server", server.url, "--data", str(prompts), "--output",
                     str(distilled), "--max-new-tokens", "12", "--concurrency", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 12
    # 2. Its features, 3. a drafter trained on them, 4. its budget tuned on this device kind, 5. its card.
    common = ["--target", folder, "--target-dtype", "float32"]
    assert main(["features", *common, "--data", str(distilled), "--output", str(features), "--batch-size", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["examples"] == 12
    assert main(["train", *common, "--features", str(features), "--output-dir", str(run), "--mixed-precision", "no",
                 "--no-progress", "--batch-size", "2", "--val-fraction", "0.2", "--save-steps", "0",
                 "--num-specialists", "2", "--positions-per-specialist", "1", "--draft-vocab-size", "24",
                 "--max-steps", "3", "--tree-depth", "2"]) == 0
    calibration = tmp_path / "calibration.jsonl"
    calibration.write_text("".join(json.dumps({"question_id": i, "category": "x", "turns": [words(3)]}) + "\n"
                                   for i in range(2)))
    assert main(["tune", str(run), "--target", folder, "--prompts", str(calibration), "--dtype", "float32",
                 "--top-k", "1,2", "--max-depth", "2", "--totals", "2,3", "--max-new-tokens", "8", "--repeats", "1",
                 "--lookup-tokens", ""]) == 0
    assert main(["card", str(run), "--force"]) == 0
    capsys.readouterr()

    drafter = PosSDrafter.from_pretrained(run)
    assert drafter.training_record["steps"] == 3 and drafter.training_record["data"]["examples"] == 12
    kind = device_kind("cpu", torch.float32)
    assert kind in drafter.generation_config.device_budgets and kind in drafter.tuning_record["device_kinds"]
    card = (run / "README.md").read_text()
    assert "Tuned budgets per device kind" in card and f"`{kind}`" in card and "| steps | 3 |" in card
    # The drafter drafts losslessly for the target it was trained on.
    ids = tokenizer.apply_chat_template([{"role": "user", "content": words(3)}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter), plain)
