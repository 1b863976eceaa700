"""The target the measurement scripts time: the default target, or random weights of any architecture on any device.

Kernel timings and rounding depend on the weights' shapes, not their values, so `--config FOLDER` measures a
target's architecture on a machine that lacks its weights (a model folder or its config.json; no download).
"""

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from transformers_poss.assets import DTYPES, load_default_target, resolve_dtype


def add_target_arguments(parser: argparse.ArgumentParser, default_dtype: str) -> None:
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=default_dtype)
    parser.add_argument("--device", default="cpu", help="where to run: cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--config", help="a model folder or config.json: random weights of that architecture "
                                         "instead of the default target")


def load_measured_target(args) -> torch.nn.Module:
    """The target in eval mode on `args.device`, in `args.dtype`."""
    dtype = resolve_dtype(args.dtype)
    if args.config:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=dtype)
        return model.to(args.device).eval()
    return load_default_target(dtype=dtype, device=args.device)[0]


def describe(target) -> str:
    """`NVIDIA H200` or `cpu, 2 threads`: where a measurement ran."""
    if target.device.type == "cuda":
        return torch.cuda.get_device_name(target.device)
    return f"{target.device.type}, {torch.get_num_threads()} threads"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels before reading a clock (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
