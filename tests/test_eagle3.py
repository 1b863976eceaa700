"""EAGLE-3 drafters (`drafter_type="eagle3"`): the architecture, training-inference equivalence, lossless drafting
inside `target.generate`, the published checkpoint layouts, and the speculators export."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tiny_models import DEVICE, fitted_drafter, prompts, tiny_target
from transformers_poss import PosSConfig, PosSDrafter
from transformers_poss.generation import drafting
from transformers_poss.generation.drafting import DraftSession, draft_chain
from transformers_poss.training import unrolled_forward

LAYERS = 8  # EAGLE-3's default low/mid/high states [2, L // 2, L - 3] need a target of at least 7 layers

# Drafting needs `DraftSession` to hold layer inputs of `drafter.layer_input_size` (2H for EAGLE-3); until
# generation/drafting.py does, the drafting tests are skipped (remove this marker with that change).
needs_wide_session = pytest.mark.skipif(
    not any("layer_input_size" in inspect.getsource(code) for code in (drafting, DraftSession.begin_round)),
    reason="generation/drafting.py does not yet size DraftSession's node inputs by drafter.layer_input_size",
)


def eagle3_target(family: str):
    """A tiny random 8-layer target: `"llama"` or `"qwen3"` (fp32, eval, on `DEVICE`)."""
    if family == "llama":
        return tiny_target("llama", num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=LAYERS, vocab_size=96, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config).to(DEVICE).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


_FITTED = {}


def fitted_eagle3(family: str):
    """(target, EAGLE-3 drafter with 2 specialists x 2 positions fitted briefly to the target), built once."""
    if family not in _FITTED:
        target = eagle3_target(family)
        drafter = fitted_drafter(target, drafter_type="eagle3", steps=100, tree_depth=4,
                                 tree_top_k=3, tree_total_tokens=12)
        _FITTED[family] = (target, drafter)
    return _FITTED[family]


# ---- architecture ------------------------------------------------------------------------------------------------
def test_eagle3_config_defaults_and_shapes():
    target = eagle3_target("llama")
    drafter = PosSDrafter.from_target(target, drafter_type="eagle3", num_specialists=2, positions_per_specialist=3)
    config = drafter.config
    assert config.feature_layers == [2, 4, 5] and config.input_feature_layers == [2, 4, 5, -1]
    assert config.draft_vocab_size == 96 and config.fc_bias is False and drafter.layer_input_size == 128
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes["fc.weight"] == (64, 192) and shapes["norm.weight"] == (64,)
    assert shapes["specialists.1.self_attn.q_proj.weight"] == (64, 128)
    assert shapes["specialists.1.self_attn.k_proj.weight"] == (32, 128)
    assert shapes["specialists.1.hidden_norm.weight"] == (64,)
    assert shapes["draft_lm_head.weight"] == (96, 64)
    with pytest.raises(ValueError, match="at least 7 layers"):
        PosSDrafter.from_target(tiny_target("llama"), drafter_type="eagle3")
    with pytest.raises(ValueError, match="final state"):
        PosSDrafter.from_target(target, drafter_type="eagle3", feature_layers=[2, 4, -1])
    with pytest.raises(ValueError, match="EAGLE-3 setting"):
        PosSConfig.from_target_config(target.config, norm_before_residual=True)


def test_eagle3_layer_matches_the_reference_equations():
    """One specialist, written out: attention over [norm(e), norm(h)] with h (or norm(h)) as residual, then the MLP;
    logits through the drafter's own norm and head."""
    target = eagle3_target("llama")
    for norm_before_residual in (False, True):
        torch.manual_seed(1)
        drafter = PosSDrafter.from_target(target, drafter_type="eagle3", norm_before_residual=norm_before_residual)
        layer = drafter.specialists[0]
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, drafter.norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
        ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        with torch.no_grad():
            out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
            hidden = drafter.fc(torch.cat([out.hidden_states[i] for i in (2, 4, 5)], dim=-1))
            got = drafter(ids, drafter.fuse_features(drafter.target_features(out.hidden_states)), return_logits=True)
            embeds = target.get_input_embeddings()(ids)
            normed = layer.hidden_norm(hidden)
            attention_input = torch.cat((layer.input_layernorm(embeds), normed), dim=-1)
            positions = torch.arange(7, device=DEVICE)[None]
            causal = torch.full((7, 7), float("-inf"), device=DEVICE).triu(1)[None, None]
            attended, _ = layer.self_attn(attention_input, drafter.rotary_emb(attention_input, positions), causal)
            mid = (normed if norm_before_residual else hidden) + attended
            expected = mid + layer.mlp(layer.post_attention_layernorm(mid))
        torch.testing.assert_close(got.features, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.logits, drafter.draft_lm_head(drafter.norm(expected)), rtol=1e-5, atol=1e-5)


@needs_wide_session
@pytest.mark.parametrize("num_specialists,k", [(1, 1), (2, 2)])
def test_eagle3_unrolled_steps_equal_inference_drafting(num_specialists, k):
    """Unroll step j of the training forward = `draft_chain`'s depth j + 1 on the same sequence (fp32): the drafter's
    own pre-norm output feeds the next position, the context reads fc(low, mid, high)."""
    target = eagle3_target("llama")
    torch.manual_seed(3)
    drafter = PosSDrafter.from_target(target, drafter_type="eagle3", num_specialists=num_specialists,
                                      positions_per_specialist=k).eval()
    depth = 4
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        out = target(ids, output_hidden_states=drafter.config.input_feature_layers)
        features = drafter.target_features(out.hidden_states)
        predictions = unrolled_forward(drafter, ids, features, depth)
    seen = []
    original_logits = drafter.logits
    drafter.logits = lambda feats: (seen.append(feats.clone()), original_logits(feats))[1]
    max_error, compared = 0.0, 0
    try:
        for S in range(1, ids.shape[1] - depth):
            seen.clear()
            session = DraftSession(drafter)
            session.commit(features[0, :S], ids[0, 1: S + 1])
            draft_chain(session, depth, lambda level, logits: (ids[0, S + level].clone(), logits))
            for j in range(depth):
                max_error = max(max_error, (seen[j] - predictions[j][0, S - 1 + j]).abs().max().item())
                compared += 1
    finally:
        del drafter.logits
    assert compared == (ids.shape[1] - depth - 1) * depth
    scale = max(p.abs().max().item() for p in predictions)
    assert max_error <= 1e-5 * max(scale, 1.0), max_error
    gap = (predictions[2][0, 4:] - predictions[0][0, 4:]).abs().max().item()
    assert gap > 1e3 * max_error + 1e-4  # later steps really differ from teacher forcing


# ---- drafting inside generate ------------------------------------------------------------------------------------
@needs_wide_session
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eagle3_drafting_is_lossless(family):
    """fp32 greedy: tree and chain drafting with an EAGLE-3 drafter return plain `generate`'s tokens; the drafter
    accepts some drafts and the per-position statistics are there."""
    target, drafter = fitted_eagle3(family)
    accepted = 0
    for prompt in prompts(96, 3):
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
        for mode in ("tree", "chain"):
            out = target.generate(prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                                  assistant_model=drafter.with_generation_config(draft_mode=mode))
            assert out.sequences.tolist() == plain.tolist(), mode
            stats = out.speculative_stats
            assert len(stats.position_acceptance) == 4
            accepted += sum(stats.acceptance_lengths)
    assert accepted > 0
