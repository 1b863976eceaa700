"""Tiny random targets of several families, and a drafter fitted to one, for fast honest tests."""

from __future__ import annotations

import os

import torch
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from transformers_poss import PosSDrafter

FAMILIES = ("llama", "mistral", "qwen2", "gemma3")

# The device tiny targets and prompts live on: `POSS_TEST_DEVICE=cuda pytest tests` runs the suite's models on a GPU.
DEVICE = torch.device(os.environ.get("POSS_TEST_DEVICE", "cpu"))

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)


def tiny_target(family: str = "llama", vocab_size: int = 96, seed: int = 0, attn_implementation: str = "sdpa",
                **overrides):
    """A tiny random causal LM of `family`, fp32, eval mode, on `DEVICE`."""
    torch.manual_seed(seed)
    kwargs = {**_COMMON, "vocab_size": vocab_size, **overrides}
    if family == "llama":
        config, cls = LlamaConfig(**kwargs), LlamaForCausalLM
    elif family == "mistral":
        config, cls = MistralConfig(**kwargs, sliding_window=None), MistralForCausalLM
    elif family == "qwen2":
        config, cls = Qwen2Config(**kwargs), Qwen2ForCausalLM
    elif family == "qwen3":
        config, cls = Qwen3Config(**kwargs, head_dim=16), Qwen3ForCausalLM
    elif family == "gemma3":
        kwargs.update(num_hidden_layers=3, head_dim=16, sliding_window=256,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        config, cls = Gemma3TextConfig(**kwargs), Gemma3ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = attn_implementation
    model = cls(config).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def prompts(vocab_size: int = 96, count: int = 3, seed: int = 1) -> list[torch.LongTensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 9, 14, 7, 11][:count]
    return [torch.randint(0, vocab_size, (1, n), generator=generator).to(DEVICE) for n in lengths]


def distinct_adapters(drafter, std: float = 0.05, seed: int = 5):
    """Give every LoRA specialist's adapter a random non-zero B (peft starts B at zero, every specialist alike), so
    the specialists really differ; a drafter without adapters is returned unchanged."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(std=std)
    return drafter


def fitted_drafter(target, num_specialists: int = 2, positions_per_specialist: int = 2, steps: int = 500,
                   seed: int = 0, **config):
    """A drafter briefly fitted (teacher forcing) to the target's own greedy continuations and features.

    Random drafters accept almost nothing; this one accepts often but not always, so tests see rounds with no,
    some and all drafts accepted.
    """
    torch.manual_seed(seed)
    drafter = PosSDrafter.from_target(target, num_specialists=num_specialists,
                                      positions_per_specialist=positions_per_specialist, **config)
    vocab = target.config.vocab_size
    with torch.no_grad():
        sequences = [target.generate(p, max_new_tokens=40, do_sample=False) for p in prompts(vocab, 3)]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    bound = drafter.bind(target)
    drafter.train()
    for step in range(steps):
        seq = sequences[step % len(sequences)]
        with torch.no_grad():
            out = target(seq, output_hidden_states=drafter.config.input_feature_layers)
            target_features = drafter.target_features(out.hidden_states)
            final = out.hidden_states[-1]
            target_next = out.logits.argmax(-1)
        specialist = step % num_specialists
        pred = bound(seq[:, 1:], drafter.fuse_features(target_features[:, :-1]), specialist=specialist,
                     return_logits=True)
        # Position i holds (x_{i+1}, f_i) and predicts f_{i+1}, whose logits name the target's choice after x_{i+1}.
        loss = torch.nn.functional.cross_entropy(pred.logits[0], target_next[0, 1:])
        loss = loss + torch.nn.functional.smooth_l1_loss(pred.features[0], final[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()
    return drafter
