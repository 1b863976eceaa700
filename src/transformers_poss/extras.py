"""Optional dependencies. Inference needs only torch, transformers and safetensors; the rest come with extras of
`pip install "transformers-poss[EXTRA]"` (pyproject.toml): `train` (accelerate, datasets, peft), `bench` (datasets,
evaluate, matplotlib), `gguf` (gguf, accelerate: GGUF targets such as the default one), `lora` (peft: LoRA
specialists), and `test` (all of them and the test tools). Modules import them through `require`."""

from __future__ import annotations

import importlib


def require(module: str, extra: str, what: str):
    """`importlib.import_module(module)`, or an `ImportError` saying that `what` needs it and which extra installs
    it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ImportError(f'{what} needs the `{package}` package: pip install "transformers-poss[{extra}]"') from error
