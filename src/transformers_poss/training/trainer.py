"""The PosS trainer: `accelerate` (mixed precision, gradient accumulation, multi-GPU/multi-node through
`accelerate launch`), exact resume from `save_state` checkpoints, per-position validation, `save_pretrained`.

Exact resume. The batch order of epoch `e` is `randperm(n, seed, e)` (`EpochSampler`), input noise is drawn from a
generator seeded by (seed, epoch, batch, process), and checkpoints are written only right after an optimizer step,
with the counters (epoch, batches done in the epoch, steps, tokens, wall time) beside accelerate's model, optimizer,
scheduler and RNG states. A resumed run skips the batches already done (`accelerator.skip_first_batches`) and then
computes exactly what the uninterrupted run would have (same world size). SIGTERM/SIGINT (first one) make the trainer
write a checkpoint at the next optimizer step and stop; a SIGKILL loses the steps since the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field

import torch

from ..modeling_poss import PosSDrafter
from .data import EpochSampler, collate, top_token_ids
from .features import parse_feature_layers, target_features
from .objective import UnrolledObjective, feature_noise

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
TRAIN_LOG_NAME = "train_log.jsonl"  # one JSON record per line: "train" windows and "validation" results


@dataclass
class TrainingArguments:
    """Everything `poss train` / `examples/train_poss.py` accept (one flag per field, `--field-name`)."""

    output_dir: str = field(metadata={"help": "where the drafter, checkpoints and logs go"})
    target: str | None = field(default=None, metadata={"help": "target model folder or Hub id"})
    target_gguf_file: str | None = field(default=None, metadata={"help": "GGUF file name inside --target"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer (default: the target's)"})
    target_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the frozen target"})
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
    depth: int | None = field(default=None, metadata={
        "help": "unrolled training steps (default: num_specialists * positions_per_specialist, at least 3)"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "reduced draft vocabulary: the N most frequent assistant tokens of the training data"})
    draft_head_rows: int | None = field(default=None, metadata={
        "help": "store and train own head rows for only the first R draft tokens; the others read the target's "
                "lm_head rows through a trained (H+1) x H map (default: all rows own)"})
    fc_bias: bool = field(default=True, metadata={"help": "bias in the input projection"})
    specialist_intermediate_size: int | None = field(default=None, metadata={
        "help": "MLP width of the specialist layers (default: the target's); wider than an --init-from drafter's "
                "widens it, starting from what it computes"})
    feature_layers: str | None = field(default=None, metadata={
        "help": "target hidden states the drafter reads, comma separated output_hidden_states indices ending in -1 "
                "(e.g. 3,16,-1: low, mid and final, fused; default: the final one only, or what --features holds)"})
    tree_depth: int = field(default=6, metadata={"help": "inference setting saved in config.json"})
    tree_top_k: int = field(default=10, metadata={
        "help": "inference setting saved in config.json; validation also reports how often the target's token is "
                "among the drafter's top this many"})
    tree_total_tokens: int = field(default=60, metadata={"help": "inference setting saved in config.json"})
    init_from: str | None = field(default=None, metadata={
        "help": "warm start: a trained drafter whose fc and layer(s) initialise every specialist; a larger "
                "--draft-vocab-size grows its draft vocabulary (its tokens and head kept, the training data's most "
                "frequent others added)"})
    epochs: int = field(default=1, metadata={"help": "passes over the training examples"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per device per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=3e-5, metadata={"help": "AdamW learning rate"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int | None = field(default=None, metadata={"help": "linear warmup steps (default: warmup_ratio)"})
    warmup_ratio: float = field(default=0.03, metadata={"help": "warmup as a fraction of all steps"})
    grad_clip_value: float = field(default=0.5, metadata={"help": "clip gradients by value (0: off)"})
    soft_ce_weight: float = field(default=0.1, metadata={"help": "weight of the soft cross-entropy"})
    noise: float = field(default=0.2, metadata={"help": "input feature noise (U-0.5)*noise*512/len (0: off)"})
    mixed_precision: str = field(default="bf16", metadata={"help": "accelerate mixed precision: no, bf16, fp16"})
    save_steps: int = field(default=500, metadata={"help": "checkpoint every N optimizer steps (0: epoch ends)"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept"})
    save_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the saved drafter weights"})
    log_steps: int = field(default=10, metadata={"help": "log every N optimizer steps"})
    resume: str | None = field(default=None, metadata={
        "help": "'latest', a checkpoint folder, or 'auto' (latest when there is one, else a fresh start)"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, order, noise and split"})
    num_workers: int = field(default=0, metadata={"help": "data loader workers"})
    progress: bool = field(default=True, metadata={"help": "tqdm progress bars"})

    def feature_folders(self) -> list[str]:
        """The `--features` folders, in order."""
        return _folder_list(self.features)

    def val_feature_folders(self) -> list[str]:
        """The `--val-features` folders, in order."""
        return _folder_list(self.val_features)

    def feature_layer_list(self) -> list[int] | None:
        """`--feature-layers` as integers (None when not given)."""
        return None if self.feature_layers is None else parse_feature_layers(self.feature_layers)

    def unroll_depth(self) -> int:
        return self.depth if self.depth is not None else max(self.num_specialists * self.positions_per_specialist, 3)

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
                    "depth": self.unroll_depth(), "save_total_limit": self.save_total_limit}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.lr <= 0 or self.noise < 0 or self.grad_clip_value < 0 or self.soft_ce_weight < 0:
            raise ValueError("--lr must be > 0 and --noise, --grad-clip-value, --soft-ce-weight >= 0")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"--mixed-precision must be no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be >= 1")
        self.feature_layer_list()  # raises on a malformed --feature-layers


def _folder_list(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def has_checkpoint(output_dir: str) -> bool:
    """Whether `output_dir` holds a trainer checkpoint to resume."""
    return os.path.exists(os.path.join(output_dir, CHECKPOINTS, "latest"))


def split_indices(n: int, val_fraction: float, val_max: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, validation) index split; at least one training example."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7)).tolist()
    n_val = min(int(round(n * val_fraction)), val_max, n - 1) if val_fraction > 0 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


def warm_start(drafter: PosSDrafter, source: PosSDrafter | str, token_counts: torch.Tensor | None = None) -> dict:
    """Initialise `drafter` from a trained drafter: its `fc`, and its layer `min(i, n_source - 1)` into specialist
    `i` (a single-specialist EAGLE/HASS drafter goes into every specialist); its draft vocabulary and head too when
    both use one of the same size and layout (`draft_head_rows`), or grown (`grow_draft_vocab`) when this drafter's
    is larger, the source's head stores all its rows and `token_counts` `[V]` of the training data are given; its
    `fuse` when both read the same target layers (otherwise `fuse` keeps its initialisation, which passes the final
    hidden state through, so a last-layer-only source starts a fused drafter exactly where it stands). Specialists
    wider than the source's (`specialist_intermediate_size`) get its MLP in their first units and zero output weights
    on the rest, so they too start computing what the source computes.
    Returns what was copied. Raises `ValueError` for drafters of another shape."""
    if isinstance(source, str):
        source = PosSDrafter.from_pretrained(source)
    mine, theirs = drafter.config.target_config, source.config.target_config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size"):
        if mine.get(key) != theirs.get(key):
            raise ValueError(f"cannot warm start: the source drafter has {key}={theirs.get(key)!r}, "
                             f"this one {mine.get(key)!r}")
    if drafter.config.fc_bias != source.config.fc_bias:
        raise ValueError("cannot warm start: fc_bias differs between the drafters")
    with torch.no_grad():
        drafter.fc.load_state_dict(source.fc.state_dict())
        n_source = len(source.specialists)
        for i, layer in enumerate(drafter.specialists):
            _load_widened_layer(layer, source.specialists[min(i, n_source - 1)])
        copied_vocab, grown_from = False, None
        if drafter.draft_lm_head is not None and source.draft_lm_head is not None:
            mine, theirs = drafter.config, source.config
            same_head = (mine.draft_vocab_size, mine.own_draft_head_rows) == (theirs.draft_vocab_size,
                                                                               theirs.own_draft_head_rows)
            if same_head:
                drafter.draft_lm_head.load_state_dict(source.draft_lm_head.state_dict())
                if drafter.draft_head_map is not None:
                    drafter.draft_head_map.load_state_dict(source.draft_head_map.state_dict())
                drafter.draft_to_target.copy_(source.draft_to_target)
            elif (token_counts is not None and source.draft_head_map is None
                  and mine.draft_vocab_size > theirs.draft_vocab_size):
                grow_draft_vocab(drafter, source, token_counts)
                grown_from = theirs.draft_vocab_size
            copied_vocab = same_head or grown_from is not None
        copied_fuse = (drafter.fuse is not None and source.fuse is not None
                       and drafter.config.input_feature_layers == source.config.input_feature_layers)
        if copied_fuse:
            drafter.fuse.load_state_dict(source.fuse.state_dict())
    return {"source": source.config.name_or_path or "in-memory drafter", "source_specialists": n_source,
            "draft_vocab_copied": copied_vocab, "draft_vocab_grown_from": grown_from,
            "fuse_copied": copied_fuse,
            "source_feature_layers": source.config.input_feature_layers,
            "source_intermediate_size": source.specialists[0].mlp.gate_proj.out_features}


def grow_draft_vocab(drafter: PosSDrafter, source: PosSDrafter, token_counts: torch.Tensor) -> None:
    """Give `drafter` (bound, draft vocabulary `Vd`) the source's smaller draft vocabulary `[Vs]` first, then the
    `Vd - Vs` tokens most frequent in `token_counts` `[V]` (ties: lower id) that the source lacks.

    A trained head drifts from the target's `lm_head` rows it started from, so the new tokens' rows are the
    target's rows carried through the least-squares affine map that takes the source's tokens' target rows to its
    trained rows. The drafter's own head (its first `R = config.draft_head_rows` rows) gets the source's trained rows,
    then such mapped rows; that map becomes `draft_head_map` for the tokens after `R`. With `R >= Vs` the source's
    logits over its own tokens are unchanged; with `R < Vs` its tokens after `R` get mapped rows instead."""
    source_ids = source.draft_to_target.to(token_counts.device)
    rest = token_counts.clone()
    rest[source_ids] = -1
    new_ids = top_token_ids(rest, drafter.config.draft_vocab_size - len(source_ids))
    target_rows = drafter.bound_target.get_output_embeddings().weight.detach().float().cpu()
    source_rows = source.draft_lm_head.weight.detach().float().cpu()

    def with_bias(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat((rows, torch.ones(len(rows), 1)), dim=1)

    affine = torch.linalg.lstsq(with_bias(target_rows[source_ids.cpu()]), source_rows).solution  # [H + 1, H]
    own = drafter.config.own_draft_head_rows
    new_own_rows = with_bias(target_rows[new_ids[: max(own - len(source_ids), 0)].cpu()]) @ affine
    with torch.no_grad():
        drafter.draft_to_target.copy_(torch.cat((source_ids.cpu(), new_ids.cpu())))
        drafter.draft_lm_head.weight.copy_(torch.cat((source_rows[:own], new_own_rows)))
        if drafter.draft_head_map is not None:  # rows @ A + c = logits E @ (A @ f) + c . f: the map's [A; c]
            drafter.draft_head_map.weight.copy_(affine)


def _load_widened_layer(layer: torch.nn.Module, source: torch.nn.Module) -> None:
    """Copy decoder layer `source` into `layer`, whose MLP may be wider (`[I, H]` gate/up and `[H, I]` down against
    the source's `I_s <= I`): the source's units go first and the extra units' down-projection columns are zeroed,
    so the extra units add nothing until training moves them."""
    mine, theirs = layer.state_dict(), source.state_dict()
    width, source_width = layer.mlp.gate_proj.out_features, source.mlp.gate_proj.out_features
    if source_width > width:
        raise ValueError(f"cannot warm start: the source drafter's specialists are wider ({source_width} MLP units) "
                         f"than this one's ({width})")
    if source_width == width:
        layer.load_state_dict(theirs)
        return
    for name, value in theirs.items():
        if name.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            mine[name][:source_width] = value
        elif name == "mlp.down_proj.weight":
            mine[name][:, :source_width] = value
            mine[name][:, source_width:] = 0
        else:
            mine[name].copy_(value)


class PosSTrainer:
    """Trains a bound drafter on a dataset of tokenized examples (online features) or feature items (offline).

    Args:
        args: `TrainingArguments`.
        drafter: a `PosSDrafter` bound to its (frozen) target.
        train_dataset / val_dataset: torch datasets of items as `ExampleDataset` or `FeatureDataset` yield.
        data_record: description of the data, stored in `config.training_record["data"]`.
        accelerator: an `accelerate.Accelerator` (built from `args` when None).
    """

    def __init__(self, args: TrainingArguments, drafter: PosSDrafter, train_dataset, val_dataset=None,
                 data_record: dict | None = None, accelerator=None, extra_record: dict | None = None):
        from accelerate import Accelerator
        from transformers import get_linear_schedule_with_warmup

        if len(train_dataset) == 0:
            raise ValueError("no training examples")
        self.args = args
        self.accelerator = accelerator or Accelerator(
            mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)
        acc = self.accelerator
        target = drafter.bound_target
        if target is None:
            raise ValueError("bind the drafter to its target first")
        target.requires_grad_(False).eval().to(acc.device)
        drafter.to(device=acc.device, dtype=torch.float32).bind_target(target, move=False)
        self.depth = args.unroll_depth()
        objective = UnrolledObjective(drafter, self.depth, soft_ce_weight=args.soft_ce_weight, top_k=args.tree_top_k)
        optimizer = torch.optim.AdamW(objective.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                                      weight_decay=args.weight_decay)
        self.sampler = EpochSampler(len(train_dataset), seed=args.seed)
        loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=self.sampler,
                                             collate_fn=collate, num_workers=args.num_workers)
        self.model, self.optimizer, self.loader = acc.prepare(objective, optimizer, loader)
        self.steps_per_epoch = math.ceil(len(self.loader) / args.grad_accum)
        self.total_steps = self.steps_per_epoch * args.epochs
        if args.max_steps is not None:
            self.total_steps = min(self.total_steps, args.max_steps)
        self.warmup_steps = (args.warmup_steps if args.warmup_steps is not None
                             else int(args.warmup_ratio * self.total_steps))
        scheduler = get_linear_schedule_with_warmup(optimizer, self.warmup_steps * acc.num_processes,
                                                    self.total_steps * acc.num_processes)
        self.scheduler = acc.prepare(scheduler)
        self.val_dataset = val_dataset
        self.data_record = data_record or {}
        self.extra_record = extra_record or {}
        self.state = {"epoch": 0, "batch_in_epoch": 0, "global_step": 0, "tokens": 0, "loss_tokens": 0,
                      "wall_time_s": 0.0, "validation": [], "finished": False, "seed": args.seed}
        self._session_start = time.time()
        self._stop_requested = False
        self.log_path = os.path.join(args.output_dir, TRAIN_LOG_NAME)
        self.history: list[dict] = []  # per optimizer step: loss (for tests and logs)

    # ---- properties -----------------------------------------------------------------------------------------------
    @property
    def drafter(self) -> PosSDrafter:
        return self.accelerator.unwrap_model(self.model).drafter

    @property
    def objective(self) -> UnrolledObjective:
        return self.accelerator.unwrap_model(self.model)

    # ---- one micro-batch ------------------------------------------------------------------------------------------
    def _inputs(self, batch: dict, epoch: int, batch_index: int, noise: bool = True) -> dict:
        """Model inputs of a batch: target features (online when absent), noised step-0 inputs."""
        acc = self.accelerator
        if "features" in batch:
            features, argmax = batch["features"], batch["target_argmax"]
        else:
            features, argmax = target_features(self.drafter.bound_target, batch["input_ids"], batch["attention_mask"],
                                               self.drafter.config.input_feature_layers)
        inputs = {"input_ids": batch["input_ids"], "features": features, "loss_mask": batch["loss_mask"],
                  "target_argmax": argmax, "input_features": None}
        if noise and self.args.noise > 0:
            generator = torch.Generator(device=features.device)
            generator.manual_seed(((self.state["seed"] * 1_000_003 + epoch) * 1_000_003 + batch_index) * 1024
                                  + acc.process_index)
            lengths = batch["attention_mask"].sum(-1)
            inputs["input_features"] = feature_noise(features, lengths, self.args.noise, generator)
        return inputs

    # ---- training -------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run (or continue) training; returns the training record. Saves the drafter to `output_dir` at every
        epoch end and at the end."""
        args, acc = self.args, self.accelerator
        os.makedirs(args.output_dir, exist_ok=True)
        self._install_signal_handlers()
        bar = None
        if args.progress and acc.is_main_process:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_steps, initial=self.state["global_step"], desc="training", unit="step")
        window = self._empty_window()
        try:
            while self.state["epoch"] < args.epochs and not self._done():
                epoch = self.state["epoch"]
                self.sampler.epoch = epoch
                skip = self.state["batch_in_epoch"]
                loader = acc.skip_first_batches(self.loader, skip) if skip else self.loader
                self.model.train()
                for batch in loader:
                    batch_index = self.state["batch_in_epoch"]
                    with acc.accumulate(self.model):
                        out = self.model(**self._inputs(batch, epoch, batch_index))
                        acc.backward(out.loss)
                        if acc.sync_gradients and args.grad_clip_value > 0:
                            acc.clip_grad_value_(self.model.parameters(), args.grad_clip_value)
                        self.optimizer.step()
                        self.scheduler.step()
                        self.optimizer.zero_grad()
                    self._accumulate_window(window, out, batch)
                    self.state["batch_in_epoch"] += 1
                    if not acc.sync_gradients:
                        continue
                    self.state["global_step"] += 1
                    self._count_tokens(window)
                    self.history.append({"step": self.state["global_step"], "loss": window["last_loss"]})
                    if bar is not None:
                        bar.update(1)
                    if self.state["global_step"] % args.log_steps == 0:
                        self._log(window, bar)
                        window = self._empty_window()
                    stop = self._should_stop()
                    if stop or (args.save_steps and self.state["global_step"] % args.save_steps == 0):
                        self.save_checkpoint()
                    if stop or self._done():
                        break
                else:  # the epoch ran to its end
                    self.state["epoch"] += 1
                    self.state["batch_in_epoch"] = 0
                    self._end_of_epoch()
                    continue
                break
            if self._done() and not self._stop_requested and not self.state["finished"]:  # --max-steps reached
                history = self.state["validation"]
                validated = bool(history) and history[-1]["step"] == self.state["global_step"]
                if not validated:
                    self._validate()
                self.state["finished"] = True
                self.save_drafter(args.output_dir)
                self.save_checkpoint()
        finally:
            self._restore_signal_handlers()
            if bar is not None:
                bar.close()
        return self.training_record()

    def _done(self) -> bool:
        return self.args.max_steps is not None and self.state["global_step"] >= self.args.max_steps

    def _validate(self) -> None:
        """Evaluate, keep the result in the state, print it and log it (`"event": "validation"`)."""
        result = self.evaluate()
        self.state["validation"].append(result)
        if self.accelerator.is_main_process:
            accuracy = " ".join(f"{a:.3f}" for a in result["position_accuracy"])
            top_k = " ".join(f"{a:.3f}" for a in result["position_top_k_accuracy"])
            print(f"epoch {self.state['epoch']} step {self.state['global_step']}: validation accuracy by draft "
                  f"position [{accuracy}], target token in the top {result['top_k']} [{top_k}]", flush=True)
            self._write_log({"event": "validation", **result})

    def _end_of_epoch(self) -> None:
        self._validate()
        if self.state["epoch"] >= self.args.epochs:
            self.state["finished"] = True
        self.save_drafter(self.args.output_dir)
        self.save_checkpoint()

    # ---- metrics ------------------------------------------------------------------------------------------------
    def _empty_window(self) -> dict:
        zeros = torch.zeros(self.depth, dtype=torch.float64)
        return {"loss": 0.0, "batches": 0, "feature_loss": zeros.clone(), "soft_ce": zeros.clone(),
                "correct": zeros.clone(), "count": zeros.clone(), "tokens": 0, "loss_tokens": 0, "last_loss": 0.0,
                "group_loss": 0.0, "group_batches": 0}

    def _accumulate_window(self, window: dict, out, batch: dict) -> None:
        count = out.count.detach().double().cpu()
        window["loss"] += float(out.loss.detach())
        window["batches"] += 1
        window["feature_loss"] += out.feature_loss.detach().double().cpu() * count
        window["soft_ce"] += out.soft_ce.detach().double().cpu() * count
        window["correct"] += out.correct.detach().double().cpu()
        window["count"] += count
        window["tokens"] += int(batch["attention_mask"].sum())
        window["loss_tokens"] += int(count[0])
        window["group_loss"] += float(out.loss.detach())
        window["group_batches"] += 1

    def _count_tokens(self, window: dict) -> None:
        counts = torch.tensor([window["tokens"], window["loss_tokens"]], dtype=torch.float64,
                              device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        self.state["tokens"] += int(counts[0])
        self.state["loss_tokens"] += int(counts[1])
        window["tokens"] = window["loss_tokens"] = 0
        window["last_loss"] = window["group_loss"] / max(window["group_batches"], 1)
        window["group_loss"], window["group_batches"] = 0.0, 0

    def _log(self, window: dict, bar) -> None:
        count = window["count"].clamp(min=1)
        accuracy = (window["correct"] / count).tolist()
        record = {
            "event": "train", "step": self.state["global_step"], "epoch": self.state["epoch"],
            "loss": window["loss"] / max(window["batches"], 1), "lr": self.scheduler.get_last_lr()[0],
            "feature_loss": (window["feature_loss"] / count).tolist(), "soft_ce": (window["soft_ce"] / count).tolist(),
            "position_accuracy": accuracy, "tokens": self.state["tokens"],
        }
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in accuracy))
        if self.accelerator.is_main_process:
            self._write_log(record)

    def _write_log(self, record: dict) -> None:
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(self.log_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    # ---- validation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-draft-position validation (no noise): top-1 agreement with the target's greedy token (a proxy of
        acceptance alpha_p under teacher forcing), how often that token is among the drafter's `tree_top_k` best
        (what a tree can still accept), feature loss and soft CE. Exact across processes."""
        acc = self.accelerator
        objective = self.objective
        was_training = objective.training
        objective.eval()
        sums = torch.zeros(5, self.depth, dtype=torch.float64, device=acc.device)
        if self.val_dataset is not None and len(self.val_dataset):
            indices = list(range(acc.process_index, len(self.val_dataset), acc.num_processes))
            subset = torch.utils.data.Subset(self.val_dataset, indices)
            loader = torch.utils.data.DataLoader(subset, batch_size=self.args.batch_size, collate_fn=collate)
            for batch in loader:
                batch = {k: v.to(acc.device) for k, v in batch.items()}
                inputs = self._inputs(batch, 0, 0, noise=False)
                with acc.autocast():
                    out = objective(**inputs)
                count = out.count.double()
                sums += torch.stack((out.correct.double(), count, out.feature_loss.double() * count,
                                     out.soft_ce.double() * count, out.top_k_hits.double()))
        if acc.num_processes > 1:
            sums = acc.reduce(sums, reduction="sum")
        objective.train(was_training)
        count = sums[1].clamp(min=1)
        return {
            "step": self.state["global_step"], "epoch": self.state["epoch"],
            "position_accuracy": (sums[0] / count).tolist(), "feature_loss": (sums[2] / count).tolist(),
            "soft_ce": (sums[3] / count).tolist(), "positions": sums[1].long().tolist(),
            "position_top_k_accuracy": (sums[4] / count).tolist(), "top_k": objective.top_k,
            "examples": len(self.val_dataset) if self.val_dataset is not None else 0,
        }

    # ---- records, saving, resuming ----------------------------------------------------------------------------
    def training_record(self) -> dict:
        args, acc = self.args, self.accelerator
        config = self.drafter.config
        validation = self.state["validation"][-1] if self.state["validation"] else None
        return {
            "target": args.target or config.target_name_or_path,
            "data": self.data_record,
            "features": f"offline: {args.features}" if args.features else "online (frozen target in the loop)",
            "objective": {"name": "training-time test (HASS/PosS unrolled)", "depth": self.depth,
                          "soft_ce_weight": args.soft_ce_weight, "feature_loss": "smooth_l1", "noise": args.noise},
            "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [args.beta1, args.beta2],
                          "weight_decay": args.weight_decay, "grad_clip_value": args.grad_clip_value,
                          "schedule": "linear", "warmup_steps": self.warmup_steps},
            "batch": {"per_device": args.batch_size, "grad_accum": args.grad_accum,
                      "processes": acc.num_processes,
                      "sequences_per_step": args.batch_size * args.grad_accum * acc.num_processes,
                      "max_length": args.max_length},
            "mixed_precision": args.mixed_precision,
            "epochs": self.state["epoch"] + (self.state["batch_in_epoch"] / max(len(self.loader), 1)),
            "steps": self.state["global_step"],
            "tokens": self.state["tokens"],
            "trained_positions": self.state["loss_tokens"],
            "wall_time_s": round(self._wall_time(), 1),
            "validation_position_accuracy": validation["position_accuracy"] if validation else None,
            "validation": validation,
            **self.extra_record,
        }

    def _wall_time(self) -> float:
        return self.state["wall_time_s"] + (time.time() - self._session_start)

    def save_drafter(self, path: str) -> None:
        """`save_pretrained` (safetensors, `save_dtype`) with `config.training_record`; main process only."""
        acc = self.accelerator
        acc.wait_for_everyone()
        drafter = self.drafter
        drafter.config.training_record = self.training_record()
        if acc.is_main_process:
            dtype = getattr(torch, self.args.save_dtype)
            state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu())
                     for k, v in drafter.state_dict().items()}
            drafter.save_pretrained(path, state_dict=state)
        acc.wait_for_everyone()

    def save_checkpoint(self) -> str:
        """`accelerator.save_state` plus the trainer counters, in `output_dir/checkpoints/step-N`."""
        acc, args = self.accelerator, self.args
        root = os.path.join(args.output_dir, CHECKPOINTS)
        path = os.path.join(root, f"step-{self.state['global_step']:08d}")
        self.state["wall_time_s"] = self._wall_time()
        self._session_start = time.time()
        acc.save_state(path)
        if acc.is_main_process:
            with open(os.path.join(path, TRAINER_STATE), "w") as handle:
                json.dump({"state": self.state, "args": dataclasses.asdict(args)}, handle, indent=2)
            with open(os.path.join(root, "latest"), "w") as handle:
                handle.write(os.path.basename(path))
            kept = sorted(d for d in os.listdir(root) if d.startswith("step-"))
            for old in kept[: max(len(kept) - args.save_total_limit, 0)]:
                if old != os.path.basename(path):
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        acc.wait_for_everyone()
        return path

    def resume(self, checkpoint: str = "latest") -> str:
        """Load a checkpoint (`"latest"` or a folder) written by `save_checkpoint`; training continues exactly."""
        if checkpoint == "latest":
            root = os.path.join(self.args.output_dir, CHECKPOINTS)
            latest = os.path.join(root, "latest")
            if not os.path.exists(latest):
                raise ValueError(f"no checkpoint to resume in {root}")
            with open(latest) as handle:
                checkpoint = os.path.join(root, handle.read().strip())
        state_path = os.path.join(checkpoint, TRAINER_STATE)
        if not os.path.exists(state_path):
            raise ValueError(f"{checkpoint} is not a trainer checkpoint (no {TRAINER_STATE})")
        self.accelerator.load_state(checkpoint)
        with open(state_path) as handle:
            self.state = json.load(handle)["state"]
        self.sampler.seed = self.state["seed"]  # batch order and noise follow the interrupted run's seed
        self._session_start = time.time()
        return checkpoint

    # ---- stopping on signals --------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        self._previous_handlers = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: no graceful stop
            self._previous_handlers = {}

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        self._stop_requested = True
        signal.signal(signum, self._previous_handlers.get(signum, signal.SIG_DFL))  # a second signal stops at once

    def _should_stop(self) -> bool:
        flag = torch.tensor(float(self._stop_requested), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        self._stop_requested = bool(flag > 0)
        return self._stop_requested
