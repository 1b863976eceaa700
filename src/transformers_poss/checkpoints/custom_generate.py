"""The `custom_generate/` folder of a native drafter folder (written by `PosSDrafter.save_pretrained`), which makes

    target.generate(**inputs, custom_generate=DRAFTER_FOLDER_OR_REPO, trust_remote_code=True)

draft with the drafter stored there: transformers checks `custom_generate/requirements.txt` against the installed
packages, then runs `generate` from `custom_generate/generate.py`, which calls
`transformers_poss.generation.speculative_generate` (the same loop as `assistant_model=drafter`).
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER = "custom_generate"
GENERATE_PY = '''"""PosS speculative decoding for transformers' `custom_generate`:

    target.generate(**inputs, custom_generate="THIS_FOLDER_OR_REPO", trust_remote_code=True)

drafts with the PosS drafter stored here (or with an `assistant_model=` passed as well) and returns what
`target.generate(**inputs, assistant_model=drafter)` returns. Needs `pip install "{requirement}"`.
"""

from transformers_poss.generation import speculative_generate


def generate(model, assistant_model=None, **generate_kwargs):
    return speculative_generate(model, assistant_model, **generate_kwargs)
'''


def requirement(version: str) -> str:
    """The pip requirement of this library's release series: `transformers-poss>=0.1,<0.2` for 0.1.x (0.x: one minor
    version), `transformers-poss>=1.2,<2` for 1.2.x."""
    major, minor = (int(part) for part in version.split(".")[:2])
    upper = f"0.{minor + 1}" if major == 0 else str(major + 1)
    return f"transformers-poss>={major}.{minor},<{upper}"


def write_custom_generate(folder: str | os.PathLike) -> None:
    """Write `custom_generate/generate.py` and `custom_generate/requirements.txt` into drafter folder `folder`."""
    from .. import __version__

    line = requirement(__version__)
    target = Path(folder) / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    (target / "generate.py").write_text(GENERATE_PY.format(requirement=line), encoding="utf-8")
    (target / "requirements.txt").write_text(line + "\n", encoding="utf-8")
