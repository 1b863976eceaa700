"""8-bit draft products for up to 16 input rows against up to 4 (`modeling_poss.INT8_MAX_ROWS`), in one process.

    python benchmarks/cpu-bf16-lean-specialists/int8_rows_ab.py [--repeated] --budget 6/4/12/4096 ...

Runs `lean_ab.py`'s comparison with its "earlier" path replaced: "earlier" is 4 rows (the library's setting), "lean"
is 16 rows.
"""

import contextlib
import importlib.util
from pathlib import Path

from transformers_poss import modeling_poss

spec = importlib.util.spec_from_file_location("lean_ab", Path(__file__).with_name("lean_ab.py"))
lean_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lean_ab)


@contextlib.contextmanager
def four_rows(drafter):
    modeling_poss.INT8_MAX_ROWS = 4
    try:
        yield
    finally:
        modeling_poss.INT8_MAX_ROWS = 16


if __name__ == "__main__":
    modeling_poss.INT8_MAX_ROWS = 16
    lean_ab.earlier_path = four_rows
    lean_ab.main()
