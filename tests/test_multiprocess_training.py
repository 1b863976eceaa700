"""Training launched as users launch it on several CPU processes: torchrun forms one gloo group whose rank 0 alone
writes the output folder and whose weights equal one process with the same global batch; launches that would not
form one group are refused before any work."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import transformers_poss
from test_training import SMOLLM2_TEMPLATE, fresh_accelerate, make_tokenizer  # noqa: F401 (a fixture)
from tiny_models import tiny_target
from transformers_poss.training import TrainingArguments
from transformers_poss.training.cli import build_train_parser, run_train
from transformers_poss.training.trainer import build_accelerator, launched_processes

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train_poss.py"
WRITE_AUDIT = Path(__file__).resolve().parent / "write_audit"  # its sitecustomize records each process's writes
LAUNCH_TIMEOUT_S = 600


@pytest.fixture
def run_files(tmp_path):
    """A tiny target folder (model + word-level chat tokenizer) and 10 conversations (8 train, 2 validation)."""
    tokenizer = make_tokenizer(SMOLLM2_TEMPLATE)
    target = tiny_target("llama", vocab_size=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    generator = torch.Generator().manual_seed(0)

    def words(prefix: str, n: int) -> str:
        return " ".join(f"{prefix}{int(i)}" for i in torch.randint(0, 30, (n,), generator=generator))

    records = [{"conversations": [{"from": "human", "value": words("u", 4 + i % 3)},
                                  {"from": "gpt", "value": words("a", 6 + i % 4)}]} for i in range(10)]
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    return tmp_path


def train_flags(files: Path, output: Path, batch_size: int, grad_accum: int) -> list[str]:
    """`poss train` flags: fp32, online features, noise on, 2 epochs; the drafter saved in fp32 to compare."""
    return ["--target", str(files / "target"), "--target-dtype", "float32", "--data",
            str(files / "conversations.jsonl"), "--output-dir", str(output), "--mixed-precision", "no",
            "--no-progress", "--num-specialists", "2", "--positions-per-specialist", "1", "--epochs", "2",
            "--val-fraction", "0.2", "--save-steps", "0", "--save-dtype", "float32", "--lr", "3e-3",
            "--log-steps", "1", "--batch-size", str(batch_size), "--grad-accum", str(grad_accum)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_environment(**extra: str) -> dict:
    """This environment, with this checkout's package first on the path and no launcher variables of its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")}
    paths = [*extra.pop("PYTHONPATH", "").split(os.pathsep), str(Path(transformers_poss.__file__).parents[1]),
             env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    return env


def test_torchrun_two_cpu_processes_train_as_one_group(run_files, tmp_path, fresh_accelerate):
    """`torchrun --nproc_per_node 2 examples/train_poss.py ...` (2 processes x batch 1): one gloo group whose
    record says 2 processes, whose rank 0 alone writes the folder (each log line once), and whose weights equal one
    process with batch 1 and 2-step gradient accumulation (same global batch, order and noise)."""
    group, audit = tmp_path / "group", tmp_path / "audit"
    audit.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(TRAIN_SCRIPT), *train_flags(run_files, group, 1, 1)]
    env = launch_environment(PYTHONPATH=str(WRITE_AUDIT), WRITE_AUDIT_ROOT=str(group), WRITE_AUDIT_LOG=str(audit))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]

    record = json.loads((group / "training_record.json").read_text())
    assert record["batch"]["processes"] == 2 and record["batch"]["sequences_per_step"] == 2
    assert record["steps"] == 8  # 8 training conversations, 2 per step, 2 epochs

    # Who wrote what: every file in the folder by rank 0, except each rank's own accelerate RNG state.
    writes = {}
    for log in audit.glob("*.json"):
        entry = json.loads(log.read_text())
        writes[entry["rank"]] = entry["writes"]
    assert sorted(writes, key=str) == ["0", "1", None]  # the two workers and the launcher
    assert writes[None] == []
    rng_files = {"checkpoints/step-00000004/random_states_1.pkl", "checkpoints/step-00000008/random_states_1.pkl"}
    assert sorted(path for _, path in writes["1"]) == sorted(rng_files), writes["1"]  # each written once
    files = {str(p.relative_to(group)) for p in group.rglob("*") if p.is_file()}
    assert files == {path for _, path in writes["0"] if (group / path).is_file()} | rng_files, writes["0"]
    assert {"model.safetensors", "training_record.json", "README.md", "train_log.jsonl",
            "checkpoints/step-00000008/model.safetensors"} <= files
    logged = [json.loads(line) for line in (group / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["event"] == "train"] == list(range(1, 9))
    assert [r["step"] for r in logged if r["event"] == "validation"] == [4, 8]

    # One process, batch 1, 2-step accumulation: the same 2 sequences per step, in the same order, with the same noise.
    alone = tmp_path / "alone"
    assert run_train(build_train_parser().parse_args(train_flags(run_files, alone, 1, 2))) == 0
    single = json.loads((alone / "training_record.json").read_text())
    assert single["batch"]["processes"] == 1 and single["batch"]["sequences_per_step"] == 2
    assert (single["steps"], single["tokens"]) == (record["steps"], record["tokens"])
    assert single["validation"]["feature_loss"] == pytest.approx(record["validation"]["feature_loss"], rel=1e-4)
    for weights in ("model.safetensors", "checkpoints/step-00000004/model.safetensors"):
        group_weights, single_weights = load_file(group / weights), load_file(alone / weights)
        assert group_weights.keys() == single_weights.keys()
        for name, value in single_weights.items():
            torch.testing.assert_close(group_weights[name], value, rtol=1e-4, atol=1e-5, msg=f"{weights}: {name}")
    validation = [r["feature_loss"] for r in logged if r["event"] == "validation"]
    assert validation[0] != pytest.approx(validation[1], rel=1e-3)  # the weights trained between the two


def test_accelerate_launch_cpu_with_two_processes_is_refused(run_files, tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process (its simple launcher; several CPU processes
    only through mpirun): refused before any work with the commands that do start two, and nothing written."""
    output = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(TRAIN_SCRIPT), *train_flags(run_files, output, 1, 1)]
    done = subprocess.run(command, env=launch_environment(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S, cwd=REPO)
    assert done.returncode != 0
    assert "ValueError: `accelerate launch` was asked for several processes" in done.stderr, done.stderr[-4000:]
    assert "torchrun --nproc_per_node N" in done.stderr
    assert not output.exists()


@pytest.mark.parametrize("environ,message", [
    ({"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "started this one alone"),
    ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "started this one alone"),
    ({"WORLD_SIZE": "2"}, "the launcher started 2 processes but accelerate groups 1"),
    ({"WORLD_SIZE": "1", "RANK": "0", "ACCELERATE_USE_CPU": "true", "MASTER_ADDR": "127.0.0.1"}, None),
    ({}, None),
])
def test_launches_that_do_not_form_one_group_are_refused(environ, message, fresh_accelerate):
    """The checks on the launch environment (what `accelerate launch` and torchrun set), without starting processes:
    a launcher's world size that accelerate does not group (an environment given to the check only, so accelerate
    itself sees one process) is refused like a launcher that started one process of several; one process is not."""
    args = TrainingArguments(output_dir="unused", target="t", data="d")
    if message is None:  # one process, as launched (`torchrun --nproc_per_node 1`, or no launcher)
        assert build_accelerator(args, environ=environ).num_processes == 1
        return
    with pytest.raises(ValueError, match=message):
        build_accelerator(args, environ=environ)


def test_launched_processes_reads_the_launchers_variables():
    assert launched_processes({}) == 1
    assert launched_processes({"WORLD_SIZE": "4", "RANK": "1"}) == 4
    assert launched_processes({"OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert launched_processes({"PMI_SIZE": "2"}) == 2
