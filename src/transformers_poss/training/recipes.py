"""Reference training recipes, one per drafter kind: what `poss train` uses for every setting a flag leaves unset.

- `hass-poss` (EAGLE-2-style drafters, `--drafter-type eagle`): the PosS authors' HASS fork (shrango/PosS
  `train/main_poss.py`, `train_poss.sh`): fed-back predictions detached, feature + 0.1 soft-CE loss, input noise 0.2,
  AdamW lr 3e-5 betas (0.9, 0.95), gradients clipped by value 0.5, linear schedule after 3% warmup; the unroll depth
  covers every specialist's positions (at least 3).
- `specforge-eagle3` (EAGLE-3-style drafters, `--drafter-type eagle3`): SpecForge's EAGLE-3 defaults
  (`specforge/config/schema.py` `TrainingConfig`, the TTT loop of `specforge/algorithms/eagle3/model.py`): 7 TTT
  steps whose gradients flow through the fed-back states, rows trained by SpecForge's unshifted loss mask, no input
  noise, AdamW lr 1e-4 betas (0.9, 0.999), gradients clipped by norm 0.5, cosine schedule after 1.5% warmup.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainingRecipe:
    """The settings a recipe fixes (each one a `TrainingArguments` field of the same name, which overrides it).

    `depth=None` means every specialist's positions, at least 3; a clipping of `None` is off.
    """

    name: str
    depth: int | None
    noise: float
    lr: float
    beta2: float
    warmup_ratio: float
    lr_schedule: str
    grad_clip_value: float | None
    grad_clip_norm: float | None
    detach_fed_back: bool
    loss_rows: str

    def settings(self) -> dict:
        """The recipe's settings by field name (without `name`)."""
        values = asdict(self)
        values.pop("name")
        return values


RECIPES = {
    "eagle": TrainingRecipe(
        name="hass-poss", depth=None, noise=0.2, lr=3e-5, beta2=0.95, warmup_ratio=0.03, lr_schedule="linear",
        grad_clip_value=0.5, grad_clip_norm=None, detach_fed_back=True, loss_rows="drafted-token"),
    "eagle3": TrainingRecipe(
        name="specforge-eagle3", depth=7, noise=0.0, lr=1e-4, beta2=0.999, warmup_ratio=0.015, lr_schedule="cosine",
        grad_clip_value=None, grad_clip_norm=0.5, detach_fed_back=False, loss_rows="state-token"),
}
RECIPE_FIELDS = tuple(RECIPES["eagle"].settings())
LR_SCHEDULES = ("linear", "cosine")
# Which drafter rows train (`objective.prediction_mask`): the token drafted is an assistant token, or the row's own
# state token is (SpecForge's unshifted mask).
LOSS_ROWS = ("drafted-token", "state-token")


def recipe_for(drafter_type: str) -> TrainingRecipe:
    """The reference recipe of a drafter kind ("eagle" or "eagle3"); `ValueError` for any other."""
    if drafter_type not in RECIPES:
        raise ValueError(f"--drafter-type must be one of {', '.join(RECIPES)}, got {drafter_type!r}")
    return RECIPES[drafter_type]
