"""Target features: computed online from a frozen target, or extracted once to disk with `datasets`.

On-disk layout (`extract_features`): a folder with `features.json` (what was extracted from what) and shards
`shard-00000, ...`, each a `datasets` `save_to_disk` folder with columns

- `input_ids` (int32 `[L]`), `loss_mask` (int8 `[L]`),
- `target_argmax` (int32 `[L]`): the target's greedy token after each position (for accuracy),
- `features` (`Array2D` uint16 `[L, nH]`): the target hidden states the drafter reads (`feature_layers`, by
  default only the final post-norm one, `n = 1`), concatenated, as bfloat16 bit patterns.

That is about `2 * nH + 9` bytes per token (1.16 KB for H = 576 and one layer). Shards are written to a temporary
name and renamed when complete, so an interrupted extraction resumes at the first missing shard.
`load_feature_dataset` memory-maps all shards.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

import numpy as np
import torch

from ..extras import require
from ..layers import select_hidden_states
from ..placement import execution_device

MANIFEST = "features.json"


@torch.no_grad()
def target_features(target, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                    feature_layers: Sequence[int] = (-1,),
                    argmax_chunk: int = 2048) -> tuple[torch.Tensor, torch.LongTensor]:
    """One frozen target forward.

    Args:
        input_ids: `[B, L]`; attention_mask: `[B, L]` (right padding).
        feature_layers: `output_hidden_states` indices to keep, ending with -1 (`PosSConfig.input_feature_layers`).
    Returns:
        (the selected hidden states concatenated, `[B, L, nH]` in the target's dtype, the final post-norm one
        last; the target's greedy next token `[B, L]`).
    """
    layers = list(feature_layers)
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=layers, logits_to_keep=1,
                 use_cache=False)
    final = out.hidden_states[-1]
    features = select_hidden_states(out.hidden_states, layers)
    lm_head = target.get_output_embeddings()
    flat = final.reshape(-1, final.shape[-1])
    argmax = torch.cat([lm_head(part.to(lm_head.weight.dtype)).argmax(-1).to(final.device)
                        for part in flat.split(argmax_chunk)])
    return features, argmax.reshape(final.shape[:-1])


def parse_feature_layers(text: str) -> list[int]:
    """`--feature-layers` ("3,16,-1") -> `[3, 16, -1]`; `ValueError` unless integers ending with -1."""
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--feature-layers takes comma separated integers, got {text!r}") from None
    return check_feature_layers(layers, "--feature-layers")


def check_feature_layers(layers: Sequence[int], name: str = "feature_layers") -> list[int]:
    """`layers` as a list; `ValueError` unless it ends with -1 (the final hidden state, which drafters predict)."""
    layers = list(layers)
    if not layers or layers[-1] != -1:
        raise ValueError(f"{name} must end with -1 (the target's final hidden state), got {layers}")
    return layers


def manifest_feature_layers(manifest: dict) -> list[int]:
    """The hidden-state indices a feature folder holds (folders written before `feature_layers` hold `[-1]`)."""
    return list(manifest.get("feature_layers") or [-1])


def bf16_bits(features: torch.Tensor) -> np.ndarray:
    """Features `[..., H]` -> bfloat16 bit patterns as a uint16 array."""
    return features.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> torch.Tensor:
    """uint16 bit patterns -> a bfloat16 tensor of the same shape."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def extract_features(
    target, examples: Sequence[dict], output_dir: str, batch_size: int = 8, shard_size: int = 256,
    metadata: dict | None = None, progress: bool = True, feature_layers: Sequence[int] = (-1,),
) -> dict:
    """Run the frozen target over tokenized examples once and save features to `output_dir` (resumable).

    Args:
        target: the target model (eval mode, any dtype/device, or split across devices by a device map).
        examples: `[{"input_ids": list[int], "loss_mask": list[int]}]`, in a fixed order (resume relies on it).
        shard_size: examples per shard (the resume granularity).
        metadata: recorded in the manifest (data source, max length...); a resumed extraction must match it.
        feature_layers: target hidden states to store (`PosSConfig.input_feature_layers` of the drafters to train).
    Returns:
        the manifest: `examples`, `tokens`, `bytes`, `bytes_per_token`, `hidden_size`, `feature_dtype`, `shards`...
    """
    datasets = require("datasets", "train", "feature extraction")
    if batch_size < 1 or shard_size < 1:
        raise ValueError("batch_size and shard_size must be >= 1")
    hidden = target.config.get_text_config().hidden_size
    feature_layers = check_feature_layers(feature_layers)
    manifest = {
        "format": "transformers_poss.features/1", "target": getattr(target.config, "_name_or_path", None),
        "hidden_size": hidden, "feature_layers": feature_layers, "feature_dtype": "bfloat16 (uint16 bits)",
        "examples": len(examples), "shard_size": shard_size, "metadata": metadata or {},
    }
    os.makedirs(output_dir, exist_ok=True)
    manifest_path = os.path.join(output_dir, MANIFEST)
    if os.path.exists(manifest_path):
        with open(manifest_path) as handle:
            previous = json.load(handle)
        keys = ("hidden_size", "examples", "shard_size", "metadata")
        if (any(previous.get(k) != json.loads(json.dumps(manifest[k])) for k in keys)
                or manifest_feature_layers(previous) != feature_layers):
            raise ValueError(f"{output_dir} holds features of other data or settings; use another folder")
    with open(manifest_path, "w") as handle:
        json.dump({**manifest, "complete": False}, handle, indent=2)

    sequence, value = datasets.Sequence, datasets.Value
    schema = datasets.Features({
        "input_ids": sequence(value("int32")), "loss_mask": sequence(value("int8")),
        "target_argmax": sequence(value("int32")),
        "features": datasets.Array2D(shape=(None, len(feature_layers) * hidden), dtype="uint16"),
    })
    device = execution_device(target.get_input_embeddings())  # a split target's first module may be offloaded
    n_shards = (len(examples) + shard_size - 1) // shard_size
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(e["input_ids"]) for e in examples), unit="tok", desc="target features")
    for shard in range(n_shards):
        part = examples[shard * shard_size: (shard + 1) * shard_size]
        final = os.path.join(output_dir, _shard_name(shard))
        if os.path.exists(final):
            if bar is not None:
                bar.update(sum(len(e["input_ids"]) for e in part))
            continue
        columns = {"input_ids": [None] * len(part), "loss_mask": [None] * len(part),
                   "target_argmax": [None] * len(part), "features": [None] * len(part)}
        order = sorted(range(len(part)), key=lambda i: len(part[i]["input_ids"]))  # less padding per batch
        for start in range(0, len(order), batch_size):
            rows = order[start: start + batch_size]
            lengths = [len(part[i]["input_ids"]) for i in rows]
            ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
            attention = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, : lengths[r]] = torch.as_tensor(part[i]["input_ids"])
                attention[r, : lengths[r]] = 1
            features, argmax = target_features(target, ids.to(device), attention.to(device), feature_layers)
            bits, argmax = bf16_bits(features), argmax.cpu().numpy().astype(np.int32)
            for r, i in enumerate(rows):
                n = lengths[r]
                columns["input_ids"][i] = np.asarray(part[i]["input_ids"], dtype=np.int32)
                columns["loss_mask"][i] = np.asarray(part[i]["loss_mask"], dtype=np.int8)
                columns["target_argmax"][i] = argmax[r, :n]
                columns["features"][i] = bits[r, :n]
            if bar is not None:
                bar.update(sum(lengths))
        temporary = final + ".tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        datasets.Dataset.from_dict(columns, features=schema).save_to_disk(temporary)
        os.replace(temporary, final)
    if bar is not None:
        bar.close()
    tokens = sum(len(e["input_ids"]) for e in examples)
    size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(output_dir) for name in names)
    manifest.update(complete=True, shards=n_shards, tokens=tokens, bytes=size,
                    bytes_per_token=size / tokens if tokens else None)
    with open(manifest_path, "w") as handle:
        json.dump(manifest, handle, indent=2)
    return manifest


def load_manifest(path: str) -> dict:
    """The manifest of a feature folder; `ValueError` if the folder holds no complete extraction."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise ValueError(f"{path} is not a feature folder (no {MANIFEST}); create one with `poss features`")
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    if not manifest.get("complete"):
        raise ValueError(f"the feature extraction in {path} is incomplete: rerun `poss features` to finish it")
    return manifest


def load_feature_dataset(path: str):
    """All shards of a feature folder as one memory-mapped `datasets.Dataset`."""
    return _shards_as_one(path, load_manifest(path))


def _shards_as_one(path: str, manifest: dict):
    datasets = require("datasets", "train", "reading feature folders")
    shards = [datasets.load_from_disk(os.path.join(path, _shard_name(i))) for i in range(manifest["shards"])]
    return datasets.concatenate_datasets(shards) if len(shards) > 1 else shards[0]


def load_feature_folders(paths: Sequence[str]) -> tuple[object, list[dict]]:
    """Several feature folders of the same target as one dataset, in order: (dataset, their manifests).

    Raises `ValueError` before loading any shard when the folders hold features of different targets (name or
    hidden size), of different target layers, or one of them is incomplete."""
    datasets = require("datasets", "train", "reading feature folders")
    if not paths:
        raise ValueError("no feature folder given")
    manifests = [load_manifest(path) for path in paths]
    for manifest in manifests:
        manifest["feature_layers"] = manifest_feature_layers(manifest)
    for key in ("hidden_size", "target", "feature_layers"):
        values = {json.dumps(m.get(key)) for m in manifests}
        if len(values) > 1:
            found = ", ".join(f"{path}: {m.get(key)!r}" for path, m in zip(paths, manifests))
            raise ValueError(f"the feature folders hold features of different targets or layers ({key}: {found})")
    parts = [_shards_as_one(path, manifest) for path, manifest in zip(paths, manifests)]
    return (datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]), manifests


class FeatureDataset(torch.utils.data.Dataset):
    """Items `{"input_ids", "loss_mask", "target_argmax": [L], "features": [L, nH] bfloat16}` from a feature
    dataset (or a subset of its rows).

    `blocks` (with `hidden_size`) keeps only these of the stored hidden states, in this order: a folder of layers
    `[3, 16, -1]` serves a last-layer drafter with `blocks=[2]`.
    """

    def __init__(self, dataset, indices: Sequence[int] | None = None, blocks: Sequence[int] | None = None,
                 hidden_size: int | None = None):
        if blocks is not None and hidden_size is None:
            raise ValueError("selecting feature blocks needs hidden_size")
        self.ids = dataset.with_format("numpy", columns=["input_ids", "loss_mask", "target_argmax"])
        self.features = dataset.with_format("numpy", columns=["features"], dtype=np.uint16)
        self.indices = list(range(len(dataset))) if indices is None else list(indices)
        self.blocks, self.hidden_size = (list(blocks), hidden_size) if blocks is not None else (None, None)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        row = self.indices[index]
        ids = self.ids[row]
        return {
            "input_ids": torch.as_tensor(ids["input_ids"], dtype=torch.long),
            "loss_mask": torch.as_tensor(ids["loss_mask"], dtype=torch.long),
            "target_argmax": torch.as_tensor(ids["target_argmax"], dtype=torch.long),
            "features": from_bf16_bits(self._select(self.features[row]["features"])),
        }

    def _select(self, bits: np.ndarray) -> np.ndarray:
        """`[L, nH]` -> `[L, len(blocks) * H]` (unchanged without `blocks`)."""
        if self.blocks is None:
            return bits
        return bits.reshape(bits.shape[0], -1, self.hidden_size)[:, self.blocks].reshape(bits.shape[0], -1)

    def token_examples(self):
        """Iterate `{"input_ids", "loss_mask"}` lists without reading features (for token counts)."""
        for row in self.indices:
            ids = self.ids[row]
            yield {"input_ids": ids["input_ids"], "loss_mask": ids["loss_mask"]}
