"""A prototype, not part of the library: `benchmarks/scripts/draft_profile.py` with each specialist layer wrapped in
`torch.compile(layer, dynamic=True)` (inductor, CPU). Run from the repository root:

    python benchmarks/cpu-bf16-lean-rounds/compiled_draft_profile.py --depth 6 --top-k 4 --total 12 \
        --deep-vocab 4096 --rounds 60

and the same command with `benchmarks/scripts/draft_profile.py` for the eager round. Prints the total time with
compilation.
"""

import importlib.util
import os
import time

import torch

from transformers_poss import PosSDrafter

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "draft_profile", os.path.join(here, "..", "scripts", "draft_profile.py"))
draft_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draft_profile)


def main() -> None:
    bind = PosSDrafter.bind_target

    def bind_and_compile(self, target, move=True):
        bound = bind(self, target, move)
        if not getattr(self, "_compiled_for_profile", False):
            for index, layer in enumerate(self.specialists):
                self.specialists[index] = torch.compile(layer, dynamic=True)
            self._compiled_for_profile = True
        return bound

    PosSDrafter.bind_target = bind_and_compile
    start = time.perf_counter()
    draft_profile.main()
    print(f"total with compilation {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
