"""PosS speculative decoding for transformers' `custom_generate`:

    target.generate(**inputs, custom_generate="THIS_FOLDER_OR_REPO", trust_remote_code=True)

drafts with the PosS drafter stored here (or with an `assistant_model=` passed as well) and returns what
`target.generate(**inputs, assistant_model=drafter)` returns. Needs `pip install "transformers-poss>=0.1,<0.2"`.
"""

from transformers_poss.generation import speculative_generate


def generate(model, assistant_model=None, **generate_kwargs):
    return speculative_generate(model, assistant_model, **generate_kwargs)
