"""Quantized targets: weight-only quantization (torchao int8) drafts losslessly, tree and chain, through transformers'
`TorchAoConfig` and through torchao's `quantize_` (which quantizes the `lm_head` too); a target quantized with torch's
`quantize_dynamic`, whose activations are quantized per forward, is refused before any work."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompts, tiny_target

from transformers_poss import PosSDrafter

MAX_NEW_TOKENS = 16


def _check_lossless(target, drafter, mode: str) -> list[int]:
    """Greedy speculative == plain on the tiny prompts; the acceptance lengths of every round."""
    view = drafter.with_generation_config(draft_mode=mode)
    accepted = []
    for prompt in prompts(count=3):
        plain = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out = target.generate(prompt, assistant_model=view, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), mode
        accepted += out.speculative_stats.acceptance_lengths
    return accepted


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_torchao_int8_weight_only_target_from_pretrained(fitted_pairs, tmp_path, mode):
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig  # torchao: the test extra
    from transformers import AutoModelForCausalLM, TorchAoConfig

    target, drafter = fitted_pairs("llama")
    target.save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())).eval()
    assert isinstance(quantized.model.layers[0].mlp.up_proj.weight, Int8Tensor)
    quantized.generation_config.eos_token_id = None
    accepted = _check_lossless(quantized, drafter, mode)
    assert max(accepted) >= 1  # the drafter, fitted to the float target, still gets drafts accepted


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_torchao_quantize_with_a_quantized_lm_head_and_a_mapped_draft_vocabulary(mode):
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, quantize_

    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target, draft_vocab_size=64, draft_head_rows=16, tree_depth=3, tree_top_k=3,
                                      tree_total_tokens=8)
    quantize_(target, Int8WeightOnlyConfig())
    assert isinstance(target.lm_head.weight, Int8Tensor)  # the draft vocabulary's mapped rows are read from it
    _check_lossless(target, drafter, mode)


@pytest.mark.parametrize("keep_lm_head", [False, True], ids=["everything", "lm-head-kept-float"])
def test_quantize_dynamic_target_is_refused_before_any_forward(keep_lm_head):
    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target)
    if keep_lm_head:  # the drafter could read the lm_head, but the layers quantize their activations per forward
        spec = {name for name, module in target.named_modules()
                if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    else:
        spec = {torch.nn.Linear}
    quantized = torch.ao.quantization.quantize_dynamic(target, spec, dtype=torch.qint8)
    assert isinstance(quantized.lm_head.weight, torch.Tensor) == keep_lm_head
    forwards = []
    quantized.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError) as error:
        quantized.generate(prompts(count=1)[0], assistant_model=drafter, max_new_tokens=4)
    message = str(error.value)
    assert "quantize_dynamic" in message and "weight-only quantization" in message and "TorchAoConfig" in message
    assert ("lm_head" in message) != keep_lm_head
    assert forwards == []
    with pytest.raises(ValueError, match="quantize_dynamic"):  # binding refuses it too (training, tools)
        drafter.bind(quantized)


def test_a_target_whose_embedding_holds_no_weights_is_refused():
    class TableLookup(torch.nn.Module):  # an embedding that keeps no `weight` tensor
        def __init__(self, embedding):
            super().__init__()
            self.table = embedding

        def forward(self, ids):
            return self.table(ids)

    target = tiny_target("llama")
    drafter = PosSDrafter.from_target(target)
    target.set_input_embeddings(TableLookup(target.get_input_embeddings()))
    with pytest.raises(ValueError, match=r"input embedding \(.*TableLookup\) holds no floating-point weight"):
        target.generate(prompts(count=1)[0], assistant_model=drafter, max_new_tokens=4)
