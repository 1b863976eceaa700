"""A frozen target larger than one device: `--target-device-map` / `--target-max-memory` read and checked, the target
loaded with accelerate's big-model placement (its layers split over GPUs, the CPU and disk), and its embedding and
`lm_head` made resident on the drafter's device for training.

A device map is `auto` (accelerate places the modules in order over the GPUs, then the CPU) or a JSON object of
module names to devices (`{"model.embed_tokens": 0, "model.layers.0": 0, ..., "lm_head": "cpu"}`, inline or in a
file); devices are GPU indices (`0`, `"cuda:1"`), `"cpu"` or `"disk"`. A memory budget is a JSON object or
`0=20GiB,cpu=64GiB` (sizes as accelerate reads them: `200MB`, `20GiB`, bytes). `auto` offloads to disk only where the
budget names disk (`disk=500GB`): a target that fits nowhere else is refused before any weight is read. Disk-offloaded
weights of a safetensors checkpoint are read from its own files; others are written to a temporary folder, removed
with the model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

DEVICE_MAP_OPTION, MAX_MEMORY_OPTION = "--target-device-map", "--target-max-memory"
OFFLOAD_DEVICES = ("cpu", "disk")
ACCELERATOR_TYPES = ("cuda", "xpu", "mps", "npu", "mlu", "hpu")


def parse_placement(device_map: str | dict | None, max_memory: str | dict | None):
    """`--target-device-map` and `--target-max-memory` as (`parse_device_map(device_map)`,
    `parse_max_memory(max_memory)`); `ValueError` for a budget without a map."""
    if max_memory is not None and device_map is None:
        raise ValueError(f"{MAX_MEMORY_OPTION} sizes a split target: give {DEVICE_MAP_OPTION} (auto or a map) too")
    return parse_device_map(device_map), parse_max_memory(max_memory)


def parse_device_map(value: str | dict | None) -> str | dict[str, int | str] | None:
    """`auto`, a JSON object or the path of a JSON file -> `"auto"` or `{module name: device}` (GPU devices as
    indices); `ValueError` for malformed JSON or a device that does not exist on this machine."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            path = Path(text).expanduser()
            if not path.is_file():
                raise ValueError(f"{DEVICE_MAP_OPTION} takes auto, a JSON object or a JSON file; {value!r} is none "
                                 "of these")
            text = path.read_text()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{DEVICE_MAP_OPTION}: malformed JSON ({error})") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{DEVICE_MAP_OPTION} must be a JSON object of module names to devices, got {value!r}")
    return {str(name): _device(device, DEVICE_MAP_OPTION) for name, device in value.items()}


def parse_max_memory(value: str | dict | None) -> dict[int | str, int] | None:
    """A JSON object or `0=20GiB,cpu=64GiB` -> `{device: bytes}` (GPU devices as indices); `ValueError` when
    malformed or naming a device that does not exist on this machine."""
    from accelerate.utils import convert_file_size_to_int

    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{MAX_MEMORY_OPTION}: malformed JSON ({error})") from None
        else:
            pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
            if not pairs or any(len(pair) != 2 for pair in pairs):
                raise ValueError(f"{MAX_MEMORY_OPTION} takes DEVICE=SIZE pairs (0=20GiB,cpu=64GiB) or a JSON object, "
                                 f"got {text!r}")
            value = {device.strip(): size.strip() for device, size in pairs}
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{MAX_MEMORY_OPTION} must name at least one device and its size, got {value!r}")
    budget = {}
    for device, size in value.items():
        try:
            size = convert_file_size_to_int(size) if isinstance(size, str) else int(size)
        except (TypeError, ValueError):
            raise ValueError(f"{MAX_MEMORY_OPTION}: {size!r} is not a size (200MB, 20GiB or bytes)") from None
        if size < 0:
            raise ValueError(f"{MAX_MEMORY_OPTION}: the size of {device} must be >= 0, got {size}")
        budget[_device(device, MAX_MEMORY_OPTION)] = size
    return budget


def _device(value, option: str) -> int | str:
    """A device of a map or budget as accelerate names it (`"cpu"`, `"disk"`, an accelerator index: `0`, `"0"` and
    `"cuda:0"` are the same); `ValueError` unless it exists on this machine."""
    text = str(value).strip().lower()
    if isinstance(value, bool) or not text:
        raise ValueError(f"{option}: {value!r} is not a device")
    if text in OFFLOAD_DEVICES:
        return text
    if text == "meta":
        raise ValueError(f"{option}: 'meta' holds no weights; offload to 'disk' instead")
    accelerator = torch.accelerator.current_accelerator()
    count = torch.accelerator.device_count() if accelerator is not None else 0
    kind, _, index = text.rpartition(":")  # "cuda:3" -> ("cuda", "3"), "3" -> ("", "3"), "cuda" -> ("", "cuda")
    if not index.isdigit():
        kind, index = index, "0"
    if kind and kind not in ACCELERATOR_TYPES:
        raise ValueError(f"{option}: {value!r} is not a device (cpu, disk, a GPU index or cuda:N)")
    if (kind and (accelerator is None or kind != accelerator.type)) or int(index) >= count:
        here = ", ".join(["cpu", "disk"] + [f"{accelerator.type}:{i}" for i in range(count)])
        raise ValueError(f"{option}: device {value!r} does not exist on this machine (devices here: {here})")
    return "mps" if kind == "mps" else int(index)  # accelerate names Apple's GPU "mps", the others by index


def plan_device_map(path: str | Path, dtype: torch.dtype, device_map: str | dict,
                    max_memory: dict | None = None) -> dict[str, int | str]:
    """Where each module of the target in folder `path` goes, decided from its config alone (no weight is read).

    `auto` places modules as `from_pretrained(device_map="auto")` does (balanced over the GPUs of `max_memory`, then
    the CPU); a map is checked to name modules of the target and to place every weight. `ValueError` when a module
    would go to disk that `max_memory` does not allow (`auto` without a `disk` budget), or a device would hold more
    than its budget."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):  # weights without storage; tied ones stay one tensor (counted once)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if device_map == "auto":
        no_split = model._no_split_modules
        budget = get_balanced_memory(model, max_memory=dict(max_memory) if max_memory else None,
                                     no_split_module_classes=no_split)
        plan = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split,
                                     no_placement_params=getattr(model, "_no_placement_params", None))
    else:
        plan = dict(device_map)
        _check_covers(model, plan)
    placed = _bytes_per_device(model, plan)
    total = sum(placed.values())
    if device_map == "auto" and placed.get("disk") and "disk" not in (max_memory or {}):
        raise ValueError(
            f"the target ({_gib(total)} in {str(dtype).removeprefix('torch.')}) does not fit in {MAX_MEMORY_OPTION} "
            f"{_describe(max_memory)}: {_gib(placed['disk'])} of it would go to disk. Give its devices more memory, "
            f"or allow disk offload (slow) with disk=SIZE in {MAX_MEMORY_OPTION}")
    for device, size in placed.items():
        if max_memory and device in max_memory and size > max_memory[device]:
            raise ValueError(f"{DEVICE_MAP_OPTION} puts {_gib(size)} of the target on {device!r}, more than its "
                             f"{_gib(max_memory[device])} in {MAX_MEMORY_OPTION}")
    return plan


def _check_covers(model: torch.nn.Module, plan: dict) -> None:
    """`ValueError` unless every key of `plan` names a module or weight of `model` and every weight is placed."""
    modules = {name for name, _ in model.named_modules()} | set(model.state_dict())
    unknown = [name for name in plan if name and name not in modules]
    if unknown:
        top = ", ".join(name for name, _ in model.named_children())
        raise ValueError(f"{DEVICE_MAP_OPTION} names {', '.join(map(repr, unknown))}, not modules of the target (its "
                         f"modules: {top} and their submodules, e.g. model.layers.0)")
    missing = [name for name in model.state_dict() if _placing_key(plan, name) is None]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"{DEVICE_MAP_OPTION} places no device for {shown}: give every module a device "
                         "(or '' for the rest)")


def _placing_key(plan: dict, name: str) -> str | None:
    """The key of `plan` that places weight `name`: the longest module prefix of it (`""` covers everything)."""
    keys = [key for key in plan if key == "" or name == key or name.startswith(key + ".")]
    return max(keys, key=len) if keys else None


def _bytes_per_device(model: torch.nn.Module, plan: dict) -> dict:
    """{device: bytes of the weights `plan` puts there} (a tied weight counted once)."""
    placed = {}
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in tensors:
        key = _placing_key(plan, name)
        if key is not None:
            placed[plan[key]] = placed.get(plan[key], 0) + tensor.numel() * tensor.element_size()
    return placed


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.2f} MiB"


def _describe(max_memory: dict | None) -> str:
    if not max_memory:
        return "(default: the free memory of every device)"
    return ",".join(f"{device}={_gib(size)}" for device, size in max_memory.items())


def load_split_model(path: str | Path, dtype: torch.dtype, device_map: str | dict,
                     max_memory: dict | None = None):
    """The causal LM in folder `path` in `dtype`, eval mode, placed by `plan_device_map` (checked before any weight
    is read); `model.hf_device_map` says where each module went."""
    from transformers import AutoModelForCausalLM

    plan = plan_device_map(path, dtype, device_map, max_memory)
    offload_folder = tempfile.mkdtemp(prefix="poss-target-offload-") if "disk" in plan.values() else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=plan, offload_folder=offload_folder)
    if offload_folder is not None:
        weakref.finalize(model, shutil.rmtree, offload_folder, True)
    return model.eval()


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device when it was placed by a device map (an
    offloaded module's weights are on `meta` until it runs), else the device of its first weight."""
    hooks = [getattr(module, "_hf_hook", None)]
    hooks += list(getattr(hooks[0], "hooks", ()))  # a SequentialHook holds several
    for hook in hooks:
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return next(module.parameters()).device


def resident_embeddings(model, device: torch.device | str) -> list[str]:
    """Make `model`'s input embedding and `lm_head` resident (real weights, no offload) on `device` when accelerate
    offloaded them (weights on `meta`, loaded at each call), so that a drafter can read their weights; the model's
    own forward still runs through them (an accelerate hook moves their inputs to `device`). Weights already on a
    device stay there. Returns the names of the modules made resident."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
    from accelerate.utils import set_module_tensor_to_device

    device = torch.device(device)
    names = {id(module): name for name, module in model.named_modules()}
    resident, moved = {}, []  # id of an offloaded weight -> its resident copy (tied weights stay one tensor)
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        offloaded = [(name, weight) for name, weight in module.named_parameters(recurse=False)
                     if weight.device.type == "meta"]
        if not offloaded:
            continue
        weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights_map is None:
            raise ValueError(f"{names[id(module)]} of the target has no weights loaded and no offload to read them "
                             f"from: place it on a device in {DEVICE_MAP_OPTION}")
        values = {name: weights_map[name] for name, weight in offloaded if id(weight) not in resident}
        remove_hook_from_module(module)
        for name, weight in offloaded:
            if id(weight) not in resident:
                set_module_tensor_to_device(module, name, device, value=values[name])
                resident[id(weight)] = module._parameters[name]
            module._parameters[name] = resident[id(weight)]
        add_hook_to_module(module, AlignDevicesHook(execution_device=device))
        moved.append(names[id(module)])
    return moved
