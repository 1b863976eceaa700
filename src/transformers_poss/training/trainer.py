"""The PosS trainer: `accelerate` (mixed precision, gradient accumulation, multi-GPU/multi-node through
`accelerate launch`), exact resume from `save_state` checkpoints, per-position validation, `save_pretrained`.

Exact resume. The batch order of epoch `e` is `randperm(n, seed, e)` (`EpochSampler`), input noise is drawn from a
generator seeded by (seed, epoch, batch, process), and checkpoints are written only right after an optimizer step,
with the counters (epoch, batches done in the epoch, steps, tokens, wall time) beside accelerate's model, optimizer,
scheduler and RNG states. A resumed run skips the batches already done (`accelerator.skip_first_batches`) and then
computes exactly what the uninterrupted run would have (same world size). SIGTERM/SIGINT (first one) make the trainer
write a checkpoint at the next optimizer step and stop; a SIGKILL loses the steps since the last checkpoint.

Several processes. `torchrun --nproc_per_node N` and `accelerate launch` with N processes train as one group
(`build_accelerator`): on GPUs accelerate's own, on a machine without GPUs a CPU group (gloo), which accelerate forms
only when asked. A launch whose processes would not form one group is refused before any work. The group's micro-batch
`g` (process `p` at batch `b`: `g = b * N + p`) is batch `g` of one process, with the same noise: N processes with
batch B train as one process with batch B and N-fold gradient accumulation. Rank 0 alone writes the output folder,
except accelerate's `random_states_<rank>.pkl` of each process in a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time

import torch

from ..binding import BoundDrafter
from ..extras import require
from ..modeling_poss import PosSDrafter
from .arguments import TrainingArguments
from .data import EpochSampler, collate
from .features import target_features
from .objective import UnrolledObjective, feature_noise

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
TRAIN_LOG_NAME = "train_log.jsonl"  # one JSON record per line: "train" windows and "validation" results


# Where launchers put the number of processes they started: torchrun and `accelerate launch` (WORLD_SIZE), mpirun.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_processes(environ=None) -> int:
    """How many processes the launcher started (1 without one), from its environment variables."""
    environ = os.environ if environ is None else environ
    for name in WORLD_SIZE_VARIABLES:
        if environ.get(name):
            return int(environ[name])
    return 1


def _has_gpu() -> bool:
    """Whether this machine has an accelerator device (CUDA, XPU, ...) for accelerate to group processes on."""
    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def build_accelerator(args: TrainingArguments, environ=None):
    """The `accelerate.Accelerator` of a run: one process group for every launch. On GPUs accelerate forms it; on a
    machine without GPUs the launched processes form a CPU group (gloo), which accelerate does only with `cpu=True`.

    Raises `ValueError` before any work when the processes started do not form one group (N independent runs would
    write one folder), or when `accelerate launch` was asked for several processes and started one (its
    single-process launcher sets ACCELERATE_USE_CPU, and MASTER_ADDR only for several processes or machines)."""
    Accelerator = require("accelerate", "train", "training").Accelerator

    environ = os.environ if environ is None else environ
    launched = launched_processes(environ)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum,
                              cpu=launched > 1 and not _has_gpu())
    if accelerator.num_processes != launched:
        raise ValueError(
            f"the launcher started {launched} processes but accelerate groups {accelerator.num_processes} "
            f"({accelerator.distributed_type}): they would train as separate runs writing one folder; on a machine "
            "without a supported accelerator set ACCELERATE_USE_CPU=true to train them as one CPU group")
    launcher_counted = any(environ.get(name) for name in WORLD_SIZE_VARIABLES)
    if not launcher_counted and "ACCELERATE_USE_CPU" in environ and "MASTER_ADDR" in environ:
        raise ValueError(
            "`accelerate launch` was asked for several processes (or machines) but started this one alone: "
            "`accelerate launch --cpu`, or `--num_processes N` on fewer GPUs, starts one process per machine "
            "(several only through mpirun, --mpirun_hostfile). Start N processes on this machine with `torchrun "
            "--nproc_per_node N examples/train_poss.py ...` or `accelerate launch --multi_gpu --num_processes N "
            "examples/train_poss.py ...`: on CPUs they train as one gloo group. (One process: unset MASTER_ADDR.)")
    return accelerator


class PosSTrainer:
    """Trains a bound drafter on a dataset of tokenized examples (online features) or feature items (offline).

    Args:
        args: `TrainingArguments`.
        drafter: a `PosSDrafter` bound to its (frozen) target (`drafter.bind(target)`, a `BoundDrafter`).
        train_dataset / val_dataset: torch datasets of items as `ExampleDataset` or `FeatureDataset` yield.
        data_record: description of the data, stored in `drafter.training_record["data"]`.
        accelerator: an `accelerate.Accelerator` (`build_accelerator(args)` when None).
        init_record: how the drafter was initialised (`build_drafter`'s record), merged into its training record.
    """

    def __init__(self, args: TrainingArguments, drafter: BoundDrafter, train_dataset, val_dataset=None,
                 data_record: dict | None = None, accelerator=None, init_record: dict | None = None):
        from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

        if len(train_dataset) == 0:
            raise ValueError("no training examples")
        self.args = args
        self.accelerator = accelerator or build_accelerator(args)
        acc = self.accelerator
        if not isinstance(drafter, BoundDrafter):
            raise ValueError("train a drafter bound to its target: PosSTrainer(args, drafter.bind(target), ...)")
        drafter, target = drafter.drafter, drafter.target
        target.requires_grad_(False).eval()
        if not getattr(target, "hf_device_map", None):  # a target split by a device map stays where it was placed
            target.to(acc.device)
        drafter.to(device=acc.device, dtype=torch.float32)
        self.depth = args.unroll_depth()
        objective = UnrolledObjective(drafter, target, self.depth, soft_ce_weight=args.soft_ce_weight, top_k=args.tree_top_k,
                                      detach_fed_back=args.detach_fed_back, loss_rows=args.loss_rows)
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
        schedule = (get_cosine_schedule_with_warmup if args.lr_schedule == "cosine"
                    else get_linear_schedule_with_warmup)
        scheduler = schedule(optimizer, self.warmup_steps * acc.num_processes, self.total_steps * acc.num_processes)
        self.scheduler = acc.prepare(scheduler)
        self.val_dataset = val_dataset
        self.data_record = data_record or {}
        self.init_record = init_record or {}
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
            features, argmax = target_features(self.objective.bound.target, batch["input_ids"], batch["attention_mask"],
                                               self.drafter.config.input_feature_layers)
        inputs = {"input_ids": batch["input_ids"], "features": features, "loss_mask": batch["loss_mask"],
                  "target_argmax": argmax, "input_features": None}
        if noise and self.args.noise > 0:  # seeded by the group's micro-batch (x 1024: as before for one process)
            group_batch = batch_index * acc.num_processes + acc.process_index
            generator = torch.Generator(device=features.device)
            generator.manual_seed(((self.state["seed"] * 1_000_003 + epoch) * 1_000_003 + group_batch) * 1024)
            lengths = batch["attention_mask"].sum(-1)
            inputs["input_features"] = feature_noise(features, lengths, self.args.noise, generator)
        return inputs

    # ---- training -------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run (or continue) training; returns the training record (also `drafter.training_record`). Saves the
        drafter to `output_dir` at every epoch end and at the end."""
        args, acc = self.args, self.accelerator
        if acc.is_main_process:
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
                        if acc.sync_gradients and args.grad_clip_value:
                            acc.clip_grad_value_(self.model.parameters(), args.grad_clip_value)
                        if acc.sync_gradients and args.grad_clip_norm:
                            acc.clip_grad_norm_(self.model.parameters(), args.grad_clip_norm)
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
                    if args.val_steps and self.state["global_step"] % args.val_steps == 0:
                        self._validate()
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
                self._validate()
                self.state["finished"] = True
                self.save_drafter(args.output_dir)
                self.save_checkpoint()
        finally:
            self._restore_signal_handlers()
            if bar is not None:
                bar.close()
        self.drafter.training_record = self.training_record()
        return self.drafter.training_record

    def _done(self) -> bool:
        return self.args.max_steps is not None and self.state["global_step"] >= self.args.max_steps

    def _validate(self) -> None:
        """Evaluate, keep the result in the state, print it and log it (`"event": "validation"`); once per step."""
        history = self.state["validation"]
        if history and history[-1]["step"] == self.state["global_step"]:
            return
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
            "position_accuracy": accuracy, "tokens": self.state["tokens"], "wall_time_s": round(self._wall_time(), 1),
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
        validation = self.state["validation"][-1] if self.state["validation"] else None
        return {
            "target": self.drafter.config.target_name_or_path or args.target,
            "data": self.data_record,
            "features": f"offline: {args.features}" if args.features else "online (frozen target in the loop)",
            "recipe": args.recipe_record(),
            "objective": {"name": "training-time test (unrolled)", "depth": self.depth, **self.objective.loss_record(),
                          "noise": args.noise, "detach_fed_back": args.detach_fed_back, "loss_rows": args.loss_rows},
            "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [args.beta1, args.beta2],
                          "weight_decay": args.weight_decay, "grad_clip_value": args.grad_clip_value,
                          "grad_clip_norm": args.grad_clip_norm, "schedule": args.lr_schedule,
                          "warmup_steps": self.warmup_steps},
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
            "resumed": self.state.get("resumed", []),
            "validation_position_accuracy": validation["position_accuracy"] if validation else None,
            "validation": validation,
            **self.init_record,
        }

    def _wall_time(self) -> float:
        return self.state["wall_time_s"] + (time.time() - self._session_start)

    def save_drafter(self, path: str) -> None:
        """`save_pretrained` (safetensors, `save_dtype`) with `drafter.training_record`; main process only."""
        acc = self.accelerator
        acc.wait_for_everyone()
        drafter = self.drafter
        drafter.training_record = self.training_record()
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

    def resume(self, checkpoint: str = "latest") -> str | None:
        """Load a checkpoint written by `save_checkpoint`: a folder, `"latest"`, or `"auto"` (the latest when there
        is one, else none: a fresh start that the same command resumes later); training continues exactly.
        Returns the folder loaded (None when `"auto"` found none)."""
        if checkpoint in ("latest", "auto"):
            root = os.path.join(self.args.output_dir, CHECKPOINTS)
            latest = os.path.join(root, "latest")
            if not os.path.exists(latest):
                if checkpoint == "auto":
                    return None
                raise ValueError(f"no checkpoint to resume in {root}")
            with open(latest) as handle:
                checkpoint = os.path.join(root, handle.read().strip())
        state_path = os.path.join(checkpoint, TRAINER_STATE)
        if not os.path.exists(state_path):
            raise ValueError(f"{checkpoint} is not a trainer checkpoint (no {TRAINER_STATE})")
        self.accelerator.load_state(checkpoint)
        with open(state_path) as handle:
            self.state = json.load(handle)["state"]
        self.state.setdefault("resumed", []).append(  # how the run went on: the record's "resumed"
            {"step": self.state["global_step"], "checkpoint": os.path.abspath(checkpoint),
             "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
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
