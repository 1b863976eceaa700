"""Fixtures of the vLLM tests: run with vLLM's own python (`scripts/vllm_env.sh` builds it):

    .venv-vllm/bin/python -m pytest -q tests_vllm

The library side (exports, this library's chain-mode acceptance) runs in the main environment's python, found as
`$POSS_MAIN_PYTHON`, else `python3` on PATH; the default target is `$POSS_VLLM_TARGET`, else what `poss
fetch-target` prints. Every vLLM engine runs in a subprocess (fp32, greedy, eager, `VLLM_CPU_KVCACHE_SPACE=2`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MAX_NEW_TOKENS = 96
DEPTHS = (3, 6)


_MAIN_PYTHON: list[str] = []
# Run by the candidate: its environment (sys.prefix), its interpreter, whether it holds this library and vLLM.
_PROBE = ("import importlib.util, json, sys; print(json.dumps({'prefix': sys.prefix, 'executable': sys.executable, "
          "'poss': importlib.util.find_spec('transformers_poss') is not None, "
          "'vllm': importlib.util.find_spec('vllm') is not None}))")


def main_python() -> str:
    """The main environment's interpreter, resolved once (a pyenv shim costs a `pyenv exec` per call).

    Environments are told apart by what they hold, not by their interpreter binary: two venvs made from one Python
    resolve (`Path.resolve()`) to the same executable. The main one is a different environment (`sys.prefix`) from
    the one running these tests, and imports transformers_poss."""
    if not _MAIN_PYTHON:
        python = os.environ.get("POSS_MAIN_PYTHON") or shutil.which("python3") or shutil.which("python")
        if not python:
            pytest.fail("set POSS_MAIN_PYTHON to the python with transformers_poss installed (not vLLM's)")
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
        if probe.returncode:
            pytest.fail(f"{python} does not run:\n{probe.stderr[-2000:]}")
        facts = json.loads(probe.stdout.strip().splitlines()[-1])
        if Path(facts["prefix"]).resolve() == Path(sys.prefix).resolve():
            pytest.fail(f"POSS_MAIN_PYTHON={python} is the environment running these tests ({sys.prefix}, vLLM's): "
                        "set it to the python with transformers_poss installed")
        if not facts["poss"]:
            pytest.fail(f"{python} (environment {facts['prefix']}) cannot import transformers_poss: install it there "
                        "(pip install -e '.[test]') or set POSS_MAIN_PYTHON to the python that has it")
        resolved = subprocess.run([python, "-c", "import transformers_poss"], capture_output=True, text=True,
                                  timeout=300)
        if resolved.returncode:
            pytest.fail(f"{python} cannot import transformers_poss:\n{resolved.stderr[-2000:]}")
        _MAIN_PYTHON.append(facts["executable"])
    return _MAIN_PYTHON[0]


def run(command: list[str], timeout: float, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a subprocess (stdout and stderr together); on `check`, fail the test with the output's tail."""
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false",
                   "HF_HUB_OFFLINE": "1", **(env or {})}
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                            env=environment, cwd=ROOT)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command[:4])} ... exited {result.returncode}:\n{result.stdout[-4000:]}")
    return result


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


@contextlib.contextmanager
def vllm_serve(model: str, log_path: Path, *options: str, wait: float = 420):
    """`vllm serve MODEL OPTIONS` on the loopback (fp32, eager) until /health answers; yields its root URL
    (http://127.0.0.1:PORT) and stops the server (its process group) whatever happens, with bounded waits."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager", *options]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    log = open(log_path, "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited {server.returncode}:\n{Path(log_path).read_text()[-4000:]}")
            try:
                http_get(f"{url}/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not come up in {wait:g} s")
                time.sleep(2)
        yield url
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="session")
def target() -> str:
    if os.environ.get("POSS_VLLM_TARGET"):
        return os.environ["POSS_VLLM_TARGET"]
    out = run([main_python(), "-m", "transformers_poss.cli", "fetch-target"], timeout=900).stdout
    return out.strip().splitlines()[-1].strip()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def exports(target, workdir) -> Path:
    """poss2 (the shipped PosS-2), spec0 (its specialist 0 alone), other_target (a drafter of another target),
    eagle3 (a random EAGLE-3-style PosS drafter)."""
    folder = workdir / "exports"
    run([main_python(), str(HERE / "make_exports.py"), "--target", target, "--output", str(folder)], timeout=600)
    return folder


@pytest.fixture(scope="session")
def reference(exports, workdir) -> dict:
    """This library's plain answers and chain-mode acceptance (K = 3, 6) on the 6 chat prompts."""
    path = workdir / "library_reference.json"
    run([main_python(), str(HERE / "library_reference.py"), "--drafter", "poss2", "--depths", *map(str, DEPTHS),
         "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(path)], timeout=1200)
    return json.loads(path.read_text())


class VLLMRuns:
    """vLLM runs on the reference prompts, each once per session: `get(drafter_name or None, k)`."""

    def __init__(self, target: str, exports: Path, workdir: Path, reference_path: Path):
        self.target, self.exports, self.workdir, self.reference_path = target, exports, workdir, reference_path
        self.results: dict = {}

    def get(self, drafter: str | None, k: int = 3, method: str = "eagle", schedule: str = "none") -> dict:
        """`schedule`: "none" drafts at every batch size; "export" keeps the export's batch-size schedule."""
        key = (drafter, k if drafter else 0, schedule if drafter else "none")
        if key not in self.results:
            output = self.workdir / f"vllm_{drafter or 'plain'}_{key[1]}_{key[2]}.json"
            command = [sys.executable, str(HERE / "run_vllm.py"), "--target", self.target, "--prompts",
                       str(self.reference_path), "--output", str(output), "--max-tokens", str(MAX_NEW_TOKENS)]
            if drafter:
                command += ["--drafter", str(self.exports / drafter), "--k", str(k), "--method", method,
                            "--schedule", schedule]
            run(command, timeout=900)
            self.results[key] = json.loads(output.read_text())
        return self.results[key]


@pytest.fixture(scope="session")
def vllm_runs(target, exports, workdir, reference) -> VLLMRuns:
    return VLLMRuns(target, exports, workdir, workdir / "library_reference.json")
