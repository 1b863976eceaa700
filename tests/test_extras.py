"""Inference needs only torch, transformers and safetensors: with every optional dependency blocked the package
imports, loads drafters and drafts losslessly, and what needs one of them says which extra installs it."""

import subprocess
import sys
from pathlib import Path

import pytest

from transformers_poss.extras import require

# What the extras bring (pyproject.toml), and scipy, which only the tests use.
OPTIONAL = ("accelerate", "datasets", "peft", "evaluate", "gguf", "matplotlib", "scipy")

# `sys.modules[name] = None` makes `import name` raise ImportError and `importlib.util.find_spec(name)` return None,
# so transformers' availability checks see the package as absent too (a `sys.meta_path` finder that raises would
# break those checks instead of answering them).
WITHOUT_EXTRAS = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None
sys.path.insert(0, {str(Path(__file__).parent)!r})
"""

INFERENCE = """
import tempfile
import torch
from tiny_models import prompts, tiny_target
from transformers_poss import PosSDrafter
from transformers_poss.assets import load_default_drafter
from transformers_poss.cli import build_parser

build_parser()  # every `poss` subcommand module imports
load_default_drafter("poss2")
target = tiny_target("llama")
drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=1, tree_depth=3, tree_top_k=2,
                                  tree_total_tokens=6)
with tempfile.TemporaryDirectory() as folder:
    drafter.save_pretrained(folder)
    drafter = PosSDrafter.from_pretrained(folder)
prompt = prompts(target.config.vocab_size, 1)[0]
plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
for mode in ("tree", "chain"):
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                          assistant_model=drafter.with_generation_config(draft_mode=mode))
    assert torch.equal(out.sequences, plain) and out.speculative_stats.num_rounds > 0, mode
print("loaded optional packages:", sorted(name for name in {optional!r} if sys.modules.get(name) is not None))
"""

NEEDS_EXTRAS = """
from transformers_poss import PosSConfig, PosSDrafter
from transformers_poss.plotting import pyplot
from tiny_models import tiny_target

for call in (lambda: PosSDrafter(PosSConfig.from_target_config(tiny_target("llama").config, num_specialists=2,
                                                                lora_rank=4)),
             pyplot):
    try:
        call()
    except ImportError as error:
        print(error)
"""


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS + code], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_inference_runs_without_the_optional_dependencies():
    out = _run(INFERENCE.replace("{optional!r}", repr(OPTIONAL)))
    assert "loaded optional packages: []" in out


def test_what_needs_an_extra_names_it_when_it_is_missing():
    lines = _run(NEEDS_EXTRAS).splitlines()
    assert lines == ['LoRA specialists (`lora_rank`) needs the `peft` package: pip install "transformers-poss[lora]"',
                     'plotting needs the `matplotlib` package: pip install "transformers-poss[bench]"']


def test_require_imports_what_is_installed():
    assert require("json", "bench", "nothing").dumps([1]) == "[1]"
    with pytest.raises(ImportError, match=r'training needs the `no_such_package` package: pip install '
                                          r'"transformers-poss\[train\]"'):
        require("no_such_package.sub", "train", "training")
