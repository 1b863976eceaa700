"""The reference fixtures of `tests/fixtures/reference/` (README.md there): numbers recorded by SpecForge 0.2.0 and by
the PosS authors' SpecForge fork on tiny seeded weights, and this library's side of the same computations."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from transformers_poss import PosSDrafter
from transformers_poss.training.objective import UnrolledObjective, unrolled_forward
from transformers_poss.training.recipes import recipe_for

FIXTURES = Path(__file__).parent / "fixtures" / "reference"


@cache
def reference() -> tuple[dict, dict[str, torch.Tensor]]:
    """(`reference.json`: losses, accuracies, counts, gradient norms, sizes; `reference.safetensors`: inputs and
    per-step draft logits)."""
    return json.loads((FIXTURES / "reference.json").read_text()), load_file(FIXTURES / "reference.safetensors")


def load_pair(folder: str) -> tuple[LlamaForCausalLM, PosSDrafter]:
    """The fixture target (fp32, CPU) and the drafter read from `folder` with `from_pretrained`, bound to it."""
    target = LlamaForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()
    drafter = PosSDrafter.from_pretrained(FIXTURES / folder, target=target, dtype=torch.float32)
    return target, drafter.bind(target)


@torch.no_grad()
def target_features(target, drafter, input_ids: torch.LongTensor) -> torch.Tensor:
    """`[B, L, nH]` what the drafter reads of the target's forward over `input_ids`."""
    out = target(input_ids, output_hidden_states=drafter.config.input_feature_layers)
    return drafter.target_features(out.hidden_states)


def reference_step_logits(logits: torch.Tensor, step: int) -> torch.Tensor:
    """A reference's step-`step` logits `[B, L, Vd]` (row `u` holds the chain rooted at position `u`) on this
    library's rows `t = step .. L - 2` (row `t` is draft position `step + 1` after context `0 .. t - step`)."""
    return logits[:, : logits.shape[1] - 1 - step]


def library_ttt(drafter, target, depth: int) -> tuple[list[torch.Tensor], object, dict[str, float]]:
    """This library's side on the fixture inputs, with the objective `poss train` uses for EAGLE-3 drafters (the
    `specforge-eagle3` recipe): per-step draft logits on rows `t >= step` (`[B, L - 1 - step, Vd]`), the
    `UnrolledObjective` output, and the gradient norm of every drafter parameter after backward of its loss."""
    _, tensors = reference()
    input_ids, loss_mask = tensors["input_ids"], tensors["loss_mask"]
    features = target_features(target, drafter, input_ids)
    with torch.no_grad():
        predictions = unrolled_forward(drafter, input_ids, features, depth)  # `drafter`: bound
        logits = [drafter.logits(p)[:, step:] for step, p in enumerate(predictions)]
    recipe = recipe_for(drafter.config.drafter_type)
    assert recipe.depth == depth and recipe.noise == 0
    drafter.zero_grad(set_to_none=True)
    objective = UnrolledObjective(drafter.drafter, target, depth, detach_fed_back=recipe.detach_fed_back, loss_rows=recipe.loss_rows)
    output = objective(input_ids, features, loss_mask)
    output.loss.backward()
    norms = {name: float(p.grad.norm()) for name, p in drafter.named_parameters() if p.grad is not None}
    return logits, output, norms


def native_name(reference_name: str) -> str:
    """A reference checkpoint's parameter name -> this library's (`midlayer.` / `layers.{i}.` -> `specialists.{i}.`,
    `lm_head` -> `draft_lm_head`)."""
    name = re.sub(r"^layers\.(\d+)\.", r"specialists.\1.", reference_name)
    name = re.sub(r"^midlayer\.", "specialists.0.", name)
    return "draft_lm_head.weight" if name == "lm_head.weight" else name
