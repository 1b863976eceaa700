"""Checkpoint formats, in and out.

- `loading`: what `PosSDrafter.from_pretrained` / `save_pretrained` do besides transformers' own (readers, LoRA).
- `native`: the files of a native drafter folder besides `config.json` and the weights (budget, records).
- `research`: EAGLE-1/2, HASS and PosS research checkpoints, read on load and converted (`poss convert`).
- `eagle3`: EAGLE-3 checkpoints (SafeAILab, SpecForge, speculators), read on load and converted.
- `export`: a native drafter in an inference engine's layout (`poss export`).
- `cli`: the `poss convert` and `poss export` commands.

`transformers_poss` registers the readers with `loading.CHECKPOINT_READERS` on import; this package itself imports
nothing, so the model can read native folders without the other formats.
"""
