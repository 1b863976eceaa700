import copy
import os
import sys

# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning makes small ops ~100x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# On a GPU transformers swaps layers for kernels fetched from the Hub; offline tests keep the models' own layers.
os.environ.setdefault("USE_HUB_KERNELS", "0")

from tiny_models import fitted_drafter, tiny_target  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def fitted_pairs():
    """One (target, fitted drafter) per family, built once per session (a few seconds each). Each call hands the
    drafter out with the generation settings it was fitted with: what one test sets does not leak into the next."""
    cache, settings = {}, {}

    def get(family: str, attn_implementation: str = "sdpa", feature_layers: tuple[int, ...] | None = None):
        key = (family, attn_implementation, feature_layers)
        if key not in cache:
            target = tiny_target(family, attn_implementation=attn_implementation)
            extra = {"feature_layers": list(feature_layers)} if feature_layers else {}
            cache[key] = (target, fitted_drafter(target, tree_depth=4, tree_top_k=3, tree_total_tokens=12, **extra))
            settings[key] = copy.deepcopy(cache[key][1].generation_config)
        cache[key][1].generation_config = copy.deepcopy(settings[key])
        return cache[key]

    return get
