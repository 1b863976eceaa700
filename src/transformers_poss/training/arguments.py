"""`TrainingArguments`: the settings of a training run (one `poss train` flag per field) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..assets import DTYPES
from .features import parse_feature_layers
from .recipes import LOSS_ROWS, LR_SCHEDULES, RECIPE_FIELDS, RECIPES, recipe_for

_RECIPE_DEFAULT = " (default: the --drafter-type's reference recipe: eagle {eagle}, eagle3 {eagle3})"


def _recipe_help(text: str, name: str) -> dict:
    """A field's metadata whose help names each recipe's default."""
    values = {kind: getattr(recipe, name) for kind, recipe in RECIPES.items()}
    return {"help": text + _RECIPE_DEFAULT.format(**values), "recipe": True}


@dataclass
class TrainingArguments:
    """Everything `poss train` / `examples/train_poss.py` accept (one flag per field, `--field-name`).

    Fields of the training recipe (`recipes.RECIPE_FIELDS`: depth, noise, learning rate, beta2, warmup, schedule,
    clipping, fed-back gradients, trained rows) left as `None` take the `--drafter-type`'s reference recipe
    (`recipes.RECIPES`) when the arguments are made; `recipe_overrides` keeps what was given.
    """

    output_dir: str = field(metadata={"help": "where the drafter, checkpoints and logs go"})
    target: str | None = field(default=None, metadata={
        "help": "the target: a model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer (default: the target's)"})
    target_dtype: str = field(default="bfloat16", metadata={
        "help": f"dtype of the frozen target: {', '.join(DTYPES)} (auto: bfloat16 where the hardware computes it)"})
    target_device_map: str | None = field(default=None, metadata={
        "help": "split the frozen target across devices (accelerate's big-model placement): auto, or a JSON map of "
                "module names to devices (GPU index, cpu, disk), inline or a file; its embedding and lm_head are "
                "kept on the drafter's device (default: the whole target on the drafter's device)"})
    target_max_memory: str | None = field(default=None, metadata={
        "help": "memory per device for --target-device-map, e.g. 0=70GiB,1=70GiB,cpu=200GiB or a JSON object; auto "
                "offloads to disk only with disk=SIZE"})
    data: str | None = field(default=None, metadata={
        "help": "conversations: .json/.jsonl (ShareGPT or messages; truncated JSON arrays are fine), a save_to_disk "
                "folder or a datasets id (online target features)"})
    data_split: str = field(default="train", metadata={"help": "split of a datasets source"})
    features: str | None = field(default=None, metadata={
        "help": "feature folder from `poss features` (offline); several, comma separated, train on all of them"})
    limit: int | None = field(default=None, metadata={"help": "use at most this many conversations"})
    max_length: int = field(default=2048, metadata={"help": "tokens per conversation (longer ones are cut)"})
    val_features: str | None = field(default=None, metadata={
        "help": "feature folder(s) held out whole for validation, comma separated (then every --features example "
                "trains; default: a seeded split of --val-fraction / --val-max-examples)"})
    val_fraction: float = field(default=0.02, metadata={"help": "held-out fraction of examples"})
    val_max_examples: int = field(default=500, metadata={"help": "at most this many held-out examples"})
    num_specialists: int = field(default=1, metadata={"help": "position specialists (decoder layers)"})
    positions_per_specialist: int = field(default=1, metadata={"help": "draft positions per specialist (PosS-k)"})
    position_groups: str | None = field(default=None, metadata={
        "help": "uneven position groups instead, one size per specialist, comma separated (e.g. 1,3,4: position 1, "
                "positions 2-4, then 5 on); --num-specialists defaults to their number"})
    lora_rank: int | None = field(default=None, metadata={
        "help": "LoRA specialists: one shared layer plus a LoRA adapter of this rank per specialist (peft); start "
                "them from a trained drafter with --init-from"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA scale numerator (default: 2 * rank)"})
    depth: int | None = field(default=None, metadata=_recipe_help(
        "unrolled training steps (None: every specialist's positions, at least 3)", "depth"))
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "reduced draft vocabulary: the N most frequent assistant tokens of the training data"})
    draft_head_rows: int | None = field(default=None, metadata={
        "help": "store and train own head rows for only the first R draft tokens; the others read the target's "
                "lm_head rows through a trained (H+1) x H map (default: all rows own)"})
    fc_bias: bool | None = field(default=None, metadata={
        "help": "bias in the input projection (default: the kind's: EAGLE-2 yes, EAGLE-3 no)"})
    drafter_type: str = field(default="eagle", metadata={
        "help": "eagle (EAGLE-2/HASS/PosS layers) or eagle3 (EAGLE-3 layers over the target's low/mid/high states, "
                "its own norm and head, EAGLE-3's token-level loss; --feature-layers then names the fused states "
                "ending with -1, default 2,L/2,L-3,-1)"})
    norm_before_residual: bool = field(default=False, metadata={
        "help": "EAGLE-3 only: hidden_norm(hidden) as the attention residual (speculators' option)"})
    feature_layers: str | None = field(default=None, metadata={
        "help": "target hidden states the drafter reads, comma separated output_hidden_states indices ending in -1 "
                "(e.g. 3,16,-1: low, mid and final, fused; default: the final one only, or what --features holds)"})
    tree_depth: int = field(default=6, metadata={"help": "drafting budget saved in generation_config.json"})
    tree_top_k: int = field(default=10, metadata={
        "help": "drafting budget saved in generation_config.json; validation also reports how often the target's "
                "token is among the drafter's top this many"})
    tree_total_tokens: int = field(default=60, metadata={"help": "drafting budget saved in generation_config.json"})
    init_from: str | None = field(default=None, metadata={
        "help": "warm start: a trained drafter whose fc and layer(s) initialise every specialist; a larger "
                "--draft-vocab-size grows its draft vocabulary (its tokens and head kept, the training data's most "
                "frequent others added)"})
    epochs: int = field(default=1, metadata={"help": "passes over the training examples"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per device per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float | None = field(default=None, metadata=_recipe_help("AdamW learning rate", "lr"))
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float | None = field(default=None, metadata=_recipe_help("AdamW beta2", "beta2"))
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int | None = field(default=None, metadata={"help": "linear warmup steps (default: warmup_ratio)"})
    warmup_ratio: float | None = field(default=None, metadata=_recipe_help(
        "warmup as a fraction of all steps", "warmup_ratio"))
    lr_schedule: str | None = field(default=None, metadata=_recipe_help(
        f"learning-rate decay after the warmup: {', '.join(LR_SCHEDULES)}", "lr_schedule"))
    grad_clip_value: float | None = field(default=None, metadata=_recipe_help(
        "clip gradients by value (0: off; giving either clipping turns the other off)", "grad_clip_value"))
    grad_clip_norm: float | None = field(default=None, metadata=_recipe_help(
        "clip gradients by their global norm (0: off; giving either clipping turns the other off)",
        "grad_clip_norm"))
    detach_fed_back: bool | None = field(default=None, metadata=_recipe_help(
        "detach the predictions fed back to later unroll steps (HASS/PosS), or let gradients flow through them "
        "(EAGLE-3)", "detach_fed_back"))
    loss_rows: str | None = field(default=None, metadata=_recipe_help(
        f"which rows train: {', '.join(LOSS_ROWS)} (the token drafted, or the row's own state token, is an "
        "assistant token)", "loss_rows"))
    soft_ce_weight: float = field(default=0.1, metadata={"help": "weight of the soft cross-entropy"})
    noise: float | None = field(default=None, metadata=_recipe_help(
        "input feature noise (U-0.5)*noise*512/len (0: off)", "noise"))
    mixed_precision: str = field(default="bf16", metadata={"help": "accelerate mixed precision: no, bf16, fp16"})
    save_steps: int = field(default=500, metadata={"help": "checkpoint every N optimizer steps (0: epoch ends)"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept"})
    save_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the saved drafter weights"})
    log_steps: int = field(default=10, metadata={"help": "log every N optimizer steps"})
    val_steps: int = field(default=0, metadata={
        "help": "also validate every N optimizer steps, for curves against steps (0: at epoch ends and the end "
                "only)"})
    resume: str | None = field(default=None, metadata={
        "help": "'latest', a checkpoint folder, or 'auto' (latest when there is one, else a fresh start)"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, order, noise and split"})
    num_workers: int = field(default=0, metadata={"help": "data loader workers"})
    progress: bool = field(default=True, metadata={"help": "tqdm progress bars"})

    def __post_init__(self):
        """Fill the recipe fields left unset from the `--drafter-type`'s reference recipe."""
        if self.drafter_type not in RECIPES:  # `check` says so; nothing to fill from
            self.recipe_overrides = {}
            return
        given = {name: getattr(self, name) for name in RECIPE_FIELDS if getattr(self, name) is not None}
        self.recipe_overrides = dict(given)
        settings = recipe_for(self.drafter_type).settings()
        if "grad_clip_value" in given or "grad_clip_norm" in given:  # one clipping given: the recipe's goes
            settings["grad_clip_value"] = settings["grad_clip_norm"] = None
        for name in RECIPE_FIELDS:
            if name not in given:
                setattr(self, name, settings[name])

    def recipe_record(self) -> dict:
        """What the training record says of the recipe: its name, the settings it gave and those flags overrode."""
        recipe = recipe_for(self.drafter_type)
        return {"name": recipe.name, "drafter_type": self.drafter_type,
                "settings": {name: getattr(self, name) for name in RECIPE_FIELDS},
                "overridden": dict(self.recipe_overrides)}

    def feature_folders(self) -> list[str]:
        """The `--features` folders, in order."""
        return _folder_list(self.features)

    def val_feature_folders(self) -> list[str]:
        """The `--val-features` folders, in order."""
        return _folder_list(self.val_features)

    def feature_layer_list(self) -> list[int] | None:
        """`--feature-layers` as integers (None when not given)."""
        return None if self.feature_layers is None else parse_feature_layers(self.feature_layers)

    def position_group_list(self) -> list[int] | None:
        """`--position-groups` as integers (None when not given); `ValueError` when malformed."""
        if self.position_groups is None:
            return None
        try:
            groups = [int(part) for part in self.position_groups.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--position-groups must be comma-separated integers, got {self.position_groups!r}") from None
        if not groups or min(groups) < 1:
            raise ValueError(f"--position-groups must be integers >= 1, got {self.position_groups!r}")
        return groups

    def specialist_count(self) -> int:
        """`--num-specialists`, or the number of `--position-groups` when those are given and it was left at 1."""
        groups = self.position_group_list()
        return len(groups) if groups and self.num_specialists == 1 else self.num_specialists

    def unroll_depth(self) -> int:
        """`--depth`, or its default: every specialist's positions, at least 3."""
        if self.depth is not None:
            return self.depth
        groups = self.position_group_list()
        return max(sum(groups) if groups else self.num_specialists * self.positions_per_specialist, 3)

    def check(self) -> None:
        """Raise `ValueError` on settings that cannot train, before any work."""
        if (self.data is None) == (self.features is None):
            raise ValueError("give exactly one of --data (conversations, online features) or --features (offline)")
        if self.val_features is not None and self.features is None:
            raise ValueError("--val-features needs --features (offline features); with --data the validation "
                             "examples are a split of the data")
        both = sorted(set(self.feature_folders()) & set(self.val_feature_folders()))
        if both:
            raise ValueError(f"{', '.join(both)} is in --features and --val-features: validation must be held out")
        if self.target is None:
            raise ValueError("--target is needed (its embedding and lm_head, and features when online)")
        positive = {"max_length": self.max_length, "num_specialists": self.num_specialists,
                    "positions_per_specialist": self.positions_per_specialist, "epochs": self.epochs,
                    "batch_size": self.batch_size, "grad_accum": self.grad_accum, "log_steps": self.log_steps,
                    "depth": self.unroll_depth(), "save_total_limit": self.save_total_limit,
                    "tree_depth": self.tree_depth, "tree_top_k": self.tree_top_k,
                    "tree_total_tokens": self.tree_total_tokens}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.drafter_type not in RECIPES:
            raise ValueError(f"--drafter-type must be eagle or eagle3, got {self.drafter_type!r}")
        if (self.lr <= 0 or self.noise < 0 or (self.grad_clip_value or 0) < 0 or (self.grad_clip_norm or 0) < 0
                or self.soft_ce_weight < 0):
            raise ValueError("--lr must be > 0 and --noise, --grad-clip-value, --grad-clip-norm, --soft-ce-weight >= 0")
        if not 0 <= self.warmup_ratio < 1 or not 0 < self.beta2 < 1:
            raise ValueError(f"--warmup-ratio must be in [0, 1) and --beta2 in (0, 1), got {self.warmup_ratio}, "
                             f"{self.beta2}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.loss_rows not in LOSS_ROWS:
            raise ValueError(f"--loss-rows must be one of {', '.join(LOSS_ROWS)}, got {self.loss_rows!r}")
        if self.target_dtype not in DTYPES:
            raise ValueError(f"--target-dtype must be one of {', '.join(DTYPES)}, got {self.target_dtype!r}")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"--mixed-precision must be no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be >= 1")
        if self.val_steps < 0:
            raise ValueError(f"--val-steps must be >= 0, got {self.val_steps}")
        self.feature_layer_list()  # raises on a malformed --feature-layers
        groups = self.position_group_list()
        if groups and self.specialist_count() != len(groups):
            raise ValueError(f"--position-groups {self.position_groups} names {len(groups)} groups for "
                             f"--num-specialists {self.num_specialists}: give one group size per specialist")
        if groups and sum(groups) < self.unroll_depth():
            raise ValueError(f"--position-groups {self.position_groups} cover draft positions 1..{sum(groups)}; "
                             f"--depth {self.unroll_depth()} trains more: make the groups cover every trained position")
        if self.norm_before_residual and self.drafter_type != "eagle3":
            raise ValueError("--norm-before-residual needs --drafter-type eagle3")


def _folder_list(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]
