"""The unrolled "training-time test" objective (HASS, as PosS trains it), with position specialists.

Sequence `x_0 .. x_{L-1}` with target features `f_0 .. f_{L-1}`; drafter position `t` (`0 <= t < T = L - 1`) holds
`(x_{t+1}, f_t)` and predicts `f_{t+1}`, whose logits draft `x_{t+2}`.

Step `j = 0 .. depth-1` plays inference draft position `j + 1`. For a query at `t` it mirrors a round whose committed
context is positions `0 .. t-j` (so `S = t - j + 1`) and whose draft levels `1 .. j` sit at positions
`t-j+1 .. t`:

- input set 0: `I_0[s] = fc(embed(x_{s+1}), f_s)` (target features, the committed context; with several
  `feature_layers`, `f_s = fuse(h_s)` of the concatenated target hidden states `h_s`);
- input set `i >= 1`: `I_i[s] = fc(embed(x_{s+1}), P_{i-1}[s-1])`: the level-`i` node at position `s`, i.e. the
  (ground-truth) drafted token with the feature the drafter predicted at step `i-1` one position earlier (detached
  in the HASS/PosS recipe; EAGLE-3's lets gradients flow through it, `detach_fed_back=False`);
- step `j` runs specialist `config.specialist_for_position(j + 1)` with queries `I_j` and keys/values of sets
  `0 .. j` computed with that specialist's own weights, under the mask
  `allowed[t, (i, s)] = (i == 0 and s <= t - j) or (i >= 1 and s == t - j + i)`.

With `config.shared_context_kv` (the PosS authors' PosS-on-EAGLE-3 drafters) the specialists share one key/value
list instead: set 0's keys/values are computed by the step-0 specialist and set `i`'s by the step-`i` specialist,
each once, as their SpecForge fork's TTT keeps them (`cache_hidden`).

That is, position by position, what `DraftSession` feeds the same specialist at depth `j + 1` (test:
`tests/test_training.py::test_unrolled_steps_equal_inference_drafting`). Queries with `t < j` have no committed
context and are not trained. A query reads `T + j` of the `(j + 1) * T` keys (`unrolled_attention`, for layer
families of plain softmax attention; others attend densely under an additive mask); a specialist that joins at step
`j` first records keys/values of sets `0 .. j-1` with a projection-only pass.

Trained rows (`trained_rows`): HASS/PosS train position `t` when the token it drafts, `x_{t+2}`, is an assistant
token (`loss_rows="drafted-token"`); SpecForge's EAGLE-3 trains it when `x_t` is (`loss_rows="state-token"`: the
target shifts by one, its loss mask does not), for `t = 0 .. T-1`.

Loss of step `j` (mean over its trained positions): `SmoothL1(P_j, f_{t+1})` (mean over features) plus
`soft_ce_weight * CE(softmax(target logits of f_{t+1}), log_softmax(draft logits of P_j))`, over the draft vocabulary
(target `lm_head` rows of `draft_to_target` for the target side, the drafter's `draft_lm_head` for the draft side)
when `config.draft_vocab_size` is set, else over the target vocabulary.

EAGLE-3 drafters (`PosSEagle3Drafter`, `predicts_target_features` False) predict no target feature: their loss of step `j` is EAGLE-3's
token-level loss alone, `EAGLE3_STEP_DECAY ** j * CE(...)` over the draft vocabulary, averaged over the trained
positions whose target top-1 token is in the draft vocabulary (SafeAILab/EAGLE `eagle/traineagle3/cnets.py` masks the
others out; `eagle/traineagle3/main.py` weights step `j` by `0.8 ** j`); `soft_ce_weight` does not apply. The metrics
(`correct`, `top_k_hits`, `count`) cover every trained position, as for other drafters. With the `specforge-eagle3`
recipe this is SpecForge 0.2.0's TTT and the PosS authors' PosS-E3 TTT (less its attention-mask shift) up to each
step's normalisation (theirs divides by all `B * L` rows): `tests/test_reference_specforge.py`,
`tests/test_reference_poss_e3.py`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.utils import ModelOutput

from ..layers import LEAN_FAMILIES, additive_mask, softcap_logits
from ..modeling_poss import PosSDrafter
from .recipes import LOSS_ROWS

EAGLE3_STEP_DECAY = 0.8  # EAGLE-3's weight of unroll step j is 0.8 ** j


def unrolled_allowed(length: int, step: int, device=None) -> torch.Tensor:
    """Bool attention pattern `[T, (step + 1) * T]` of unroll step `step` (True = attend); key blocks are input
    sets `0 .. step`, each of `T = length` positions."""
    t = torch.arange(length, device=device)[:, None]
    s = torch.arange(length, device=device)[None, :]
    blocks = [s <= t - step] + [s == t - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def prediction_mask(loss_mask: torch.Tensor, loss_rows: str = "drafted-token") -> torch.Tensor:
    """Trained drafter positions `[B, T]` from the token loss mask `[B, L]`.

    "drafted-token": position `t` trains when the token it drafts, `x_{t+2}`, is an assistant token (the last
    position, whose drafted token is past the end, does not). "state-token" (SpecForge's EAGLE-3): when `x_t` is."""
    if loss_rows == "state-token":
        return loss_mask[:, :-1].bool()
    if loss_rows != "drafted-token":
        raise ValueError(f"loss_rows must be one of {LOSS_ROWS}, got {loss_rows!r}")
    mask = torch.zeros_like(loss_mask[:, 1:], dtype=torch.bool)
    mask[:, :-1] = loss_mask[:, 2:].bool()
    return mask


def unrolled_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None = None, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention of unroll step `j` under `unrolled_allowed(T, j)`, reading only the keys it allows: query `t`
    reads positions `s <= t - j` of input set 0 (the committed context) and position `t - j + i` of each set `i` in
    `1 .. j` (one draft node each). The dense masked attention scores `(j + 1) * T` keys per query; this scores
    `T + j`, as SpecForge's TTT attention does.

    Args:
        query: `[B, h, T, D]` (rotated); key, value: `[B, kv, (j + 1) * T, D]`, sets `0 .. j` in order (`h` a
            multiple of `kv`); attention_mask: the dense mask, not read (the pattern is the unroll's).
    Returns:
        `[B, T, h, D]` and no weights, as transformers' attention functions return them.
    """
    batch, heads, length, dim = query.shape
    kv_heads, steps = key.shape[1], key.shape[2] // length
    if steps * length != key.shape[2] or dropout:
        raise ValueError(f"unrolled attention takes whole input sets of {length} keys and no dropout, got "
                         f"{key.shape[2]} keys and dropout {dropout}")
    step = steps - 1
    scaling = dim ** -0.5 if scaling is None else scaling
    if step == 0:  # plain causal attention over the committed context
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(1, 2).contiguous(), None
    q = (query * scaling).view(batch, kv_heads, heads // kv_heads, length, dim)
    keys = key.view(batch, kv_heads, 1, steps, length, dim)
    values = value.view(batch, kv_heads, 1, steps, length, dim)
    t = torch.arange(length, device=query.device)
    scores = [torch.matmul(q, keys[:, :, :, 0].transpose(-1, -2))  # [B, kv, g, T, T]
              .masked_fill(t[None, :] > t[:, None] - step, float("-inf"))]
    fed_values = []
    for i in range(1, steps):  # set i at position t - (j - i): its rows shifted down by j - i
        shift = step - i
        k_i = F.pad(keys[:, :, :, i], (0, 0, shift, 0))[..., :length, :]
        fed_values.append(F.pad(values[:, :, :, i], (0, 0, shift, 0))[..., :length, :])
        scores.append((q * k_i).sum(-1, keepdim=True).masked_fill((t < shift)[:, None], float("-inf")))
    scores = torch.cat(scores, dim=-1)  # [B, kv, g, T, T + j]
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    out = torch.matmul(probs[..., :length], values[:, :, :, 0])  # [B, kv, g, T, D]
    for i, v_i in enumerate(fed_values):
        out = out + probs[..., length + i: length + i + 1] * v_i
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


UNROLLED_ATTENTION = "poss_unrolled"
AttentionInterface.register(UNROLLED_ATTENTION, unrolled_attention)


@contextmanager
def sparse_unrolled_attention(drafter: PosSDrafter):
    """Within it, the specialists of a `LEAN_FAMILIES` layer family (plain softmax attention) attend through
    `unrolled_attention`; other families keep their dense masked attention."""
    if drafter.config.layer_family not in LEAN_FAMILIES:
        yield
        return
    configs = list({id(layer.self_attn.config): layer.self_attn.config for layer in drafter.specialists}.values())
    previous = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = UNROLLED_ATTENTION
        yield
    finally:
        for config, implementation in zip(configs, previous):
            config._attn_implementation = implementation


class _SoftCrossEntropy(torch.autograd.Function):
    """`-(p * log_softmax(z)).sum(-1)` per row in float32 (or wider), in few passes over the `[N, V]` rows, each a
    fused kernel that reads a row once: `log_softmax` (kept for the gradient `(softmax(z) * sum(p) - p) * g`), then
    `p . log q`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        log_q = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # [N, V]
        with torch.autocast(logits.device.type, enabled=False):  # in float32
            loss = -torch.bmm(probs[:, None, :], log_q[:, :, None]).view(-1)  # [N], without an [N, V] product
        ctx.save_for_backward(log_q, probs)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        log_q, probs = ctx.saved_tensors
        grad_logits = log_q.exp().mul_((grad * probs.sum(-1))[:, None]).addcmul_(probs, grad[:, None], value=-1.0)
        return grad_logits.to(ctx.logits_dtype), None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy `[N]` (float32) of draft logits `[N, V]` (any float dtype) against target probabilities `[N, V]`
    (float32; no gradient to them)."""
    return _SoftCrossEntropy.apply(logits, probs.detach())


class _KVSets:
    """Duck-typed cache of one specialist during an unrolled forward: keys/values of the input sets run so far.

    With `record_only`, `update` stores the new keys/values and hands the attention a single key (a cheap, discarded
    attention), so a projection-only pass over earlier sets costs no quadratic attention.
    """

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.sets = 0
        self.record_only = False

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        if self.record_only:
            return key_states[..., :1, :], value_states[..., :1, :]
        return torch.cat(self.keys, dim=-2), torch.cat(self.values, dim=-2)


def _record_sets(drafter: PosSDrafter, specialist: int, sets: list[torch.Tensor], store: _KVSets) -> None:
    """Keys/values of input sets `[B, T, H]` each, with `specialist`'s weights, appended to `store` (no MLP)."""
    batch, length, _ = sets[0].shape
    hidden = torch.cat(sets, dim=1)
    positions = torch.arange(length, device=hidden.device).repeat(len(sets))[None].expand(batch, -1)
    attention = drafter.specialists[specialist].self_attn
    mask = torch.zeros(1, 1, hidden.shape[1], 1, dtype=hidden.dtype, device=hidden.device)
    store.record_only = True
    try:
        attention(hidden_states=drafter.attention_inputs(specialist, hidden),
                  position_embeddings=drafter.rope(hidden, positions),
                  attention_mask=mask, cache=store)
    finally:
        store.record_only = False
    store.sets += len(sets)


def check_trainable(drafter: PosSDrafter, depth: int) -> None:
    """Raise `ValueError` when `depth` leaves a specialist untrained or the attention cannot take 4D masks."""
    config = drafter.config
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"unroll depth must be an integer >= 1, got {depth!r}")
    config.check_groups_cover(depth)
    used = {config.specialist_for_position(p) for p in range(1, depth + 1)}
    if len(used) < config.num_specialists:
        needed = sum(config.group_sizes[:-1]) + 1
        raise ValueError(
            f"unroll depth {depth} never reaches specialists {sorted(set(range(config.num_specialists)) - used)}: "
            f"use depth >= {needed} for position groups {config.describe_groups()}"
        )
    implementation = drafter.specialists[0].self_attn.config._attn_implementation
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"training needs the sdpa or eager attention (4D masks), the drafter uses {implementation!r}")


def unrolled_forward(
    drafter: PosSDrafter, input_ids: torch.LongTensor, features: torch.Tensor, depth: int,
    detach_fed_back: bool = True,
) -> list[torch.Tensor]:
    """Predicted features of each unroll step.

    Args:
        input_ids: `[B, L]` tokens.
        features: `[B, L, nH]` target features (`drafter.target_features`) used as step-0 inputs (noised in
            training).
        depth: unroll steps (inference draft positions 1 .. depth).
        detach_fed_back: feed step `j` the predictions of step `j - 1` detached (HASS/PosS), or let gradients of
            later steps flow through them into earlier steps (EAGLE-3, as SpecForge and SafeAILab train).
    Returns:
        `depth` tensors `[B, T, H]` (`T = L - 1`); entry `j` at position `t` predicts `f_{t+1}` as draft position
        `j + 1` of a round with committed context `0 .. t - j` (meaningful for `t >= j`).
    """
    config = drafter.config
    next_tokens = input_ids[:, 1:]
    batch, length = next_tokens.shape
    if length < 1:
        raise ValueError("sequences need at least 2 tokens")
    positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
    sets: list[torch.Tensor] = []
    stores: dict[int, _KVSets] = {}
    predictions: list[torch.Tensor] = []
    for step in range(depth):
        if step == 0:
            step_features = drafter.fuse_features(features[:, :-1])
        else:
            previous = predictions[-1].detach() if detach_fed_back else predictions[-1]
            step_features = torch.cat((torch.zeros_like(previous[:, :1]), previous[:, :-1]), dim=1)
        layer_inputs = drafter.project(next_tokens, step_features)
        specialist = config.specialist_for_position(step + 1)
        store = stores.setdefault(0 if config.shared_context_kv else specialist, _KVSets())
        if store.sets < step:  # a specialist of its own keys/values that joins late (never with a shared list)
            _record_sets(drafter, specialist, sets[store.sets: step], store)
        sets.append(layer_inputs)
        mask = additive_mask(unrolled_allowed(length, step, layer_inputs.device), layer_inputs.dtype)
        with sparse_unrolled_attention(drafter):
            predictions.append(drafter.run_specialist(specialist, layer_inputs, positions, mask, cache=store))
        store.sets += 1
    return predictions


@dataclass
class ObjectiveOutput(ModelOutput):
    """Loss and per-step metrics of one batch (metrics are detached sums, for exact aggregation).

    Attributes:
        loss: scalar, sum over steps of `feature loss + soft_ce_weight * soft CE`.
        feature_loss, soft_ce: `[depth]` per-step means.
        correct: `[depth]` positions where the draft top-1 equals the target's top-1 token.
        top_k_hits: `[depth]` positions where the target's top-1 token is among the draft's `top_k` best (the
            tree's expansion width): what a tree drafter can still accept when its top-1 is wrong.
        count: `[depth]` trained positions per step.
    """

    loss: torch.Tensor | None = None
    feature_loss: torch.Tensor | None = None
    soft_ce: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    top_k_hits: torch.Tensor | None = None
    count: torch.Tensor | None = None


class UnrolledObjective(nn.Module):
    """Wraps a drafter so `accelerate`/DDP see one module whose `forward` returns the training loss.

    The target (embedding, `lm_head`) stays outside the module: the drafter reads it through its binding (`bound`),
    frozen, not saved.
    """

    def __init__(self, drafter: PosSDrafter, target, depth: int, soft_ce_weight: float = 0.1, top_k: int = 10,
                 detach_fed_back: bool = True, loss_rows: str = "drafted-token"):
        super().__init__()
        check_trainable(drafter, depth)
        if loss_rows not in LOSS_ROWS:
            raise ValueError(f"loss_rows must be one of {LOSS_ROWS}, got {loss_rows!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        self.drafter = drafter
        self.bound = drafter.bind(target, move=False)
        self.depth = depth
        self.soft_ce_weight = soft_ce_weight
        self.top_k = top_k
        self.detach_fed_back = detach_fed_back
        self.loss_rows = loss_rows

    def loss_record(self) -> dict:
        """The loss of each unroll step, for the training record."""
        if not self.drafter.predicts_target_features:
            return {"loss": f"token soft-CE over the draft vocabulary, step j weighted {EAGLE3_STEP_DECAY}**j"}
        return {"loss": "feature smooth-L1 + soft_ce_weight * token soft-CE", "soft_ce_weight": self.soft_ce_weight}

    # ---- target side --------------------------------------------------------------------------------------------
    def _target_head(self) -> tuple[torch.Tensor, float | None]:
        softcap = getattr(self.bound.target.config.get_text_config(), "final_logit_softcapping", None)
        return self.bound.lm_head.weight, softcap

    @torch.no_grad()
    def target_logits(self, features: torch.Tensor, draft_vocab: bool = True) -> torch.Tensor:
        """Target logits `[N, V]` (or `[N, Vd]` over the draft vocabulary) of target features `[N, H]`, float32."""
        weight, softcap = self._target_head()
        if draft_vocab and self.drafter.draft_to_target is not None:
            weight = weight[self.drafter.draft_to_target.to(weight.device)]
        logits = F.linear(features.to(device=weight.device, dtype=weight.dtype), weight).float()
        return softcap_logits(logits, softcap).to(features.device)

    @torch.no_grad()
    def greedy_tokens(self, features: torch.Tensor, chunk: int = 1024) -> torch.LongTensor:
        """The target's greedy token `[N]` for features `[N, H]` (full vocabulary, in chunks)."""
        return torch.cat([self.target_logits(part, draft_vocab=False).argmax(-1)
                          for part in features.split(chunk)]) if features.shape[0] else \
            torch.zeros(0, dtype=torch.long, device=features.device)

    # ---- loss ---------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.LongTensor, features: torch.Tensor, loss_mask: torch.Tensor,
                input_features: torch.Tensor | None = None,
                target_argmax: torch.LongTensor | None = None) -> ObjectiveOutput:
        """
        Args:
            input_ids: `[B, L]`; features: `[B, L, nH]` clean target features (`drafter.target_features`; the
            final hidden state, their last `H` columns, is the regression target); loss_mask: `[B, L]` assistant
            tokens; input_features: `[B, L, nH]` step-0 inputs (noised), defaults to `features`; target_argmax:
            `[B, L]` the target's greedy token after each position (computed when None).
        """
        drafter = self.bound
        predictions = unrolled_forward(drafter, input_ids, features if input_features is None else input_features,
                                       self.depth, detach_fed_back=self.detach_fed_back)
        trained = prediction_mask(loss_mask, self.loss_rows)  # [B, T]
        rows, cols = trained.nonzero(as_tuple=True)
        hidden = drafter.config.hidden_size
        goal = features[:, 1:, -hidden:][rows, cols].float()  # [N, H] f_{t+1}, the final hidden state
        target_probs = torch.softmax(self.target_logits(goal), dim=-1)  # [N, V']
        if target_argmax is not None:
            greedy = target_argmax[:, 1:][rows, cols]
        else:
            greedy = self.greedy_tokens(goal)
        device = goal.device
        feature_loss_trained = drafter.predicts_target_features
        if not feature_loss_trained:  # EAGLE-3 trains only where the target's top token can be drafted
            drafted = torch.zeros(drafter.config.vocab_size, dtype=torch.bool, device=device)
            drafted[drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=device))] = True
            in_draft_vocab = drafted[greedy.to(device)]
        total = torch.zeros((), device=device)
        feature_losses, soft_ces, corrects, top_k_hits, counts = [], [], [], [], []
        for step, predicted in enumerate(predictions):
            # every step scores all N trained rows and weighs out those without a committed context (t < step: at
            # most `step` rows a sequence), sparing an [N, V'] copy of the target's probabilities per step
            keep = (cols >= step).float()  # [N]
            n = int(keep.sum())
            if n == 0:
                zero = predicted.sum() * 0.0  # keeps every parameter in the graph (DDP)
                total = total + zero
                feature_losses.append(zero.detach().float())
                soft_ces.append(zero.detach().float())
                corrects.append(torch.zeros((), device=device))
                top_k_hits.append(torch.zeros((), device=device))
                counts.append(torch.zeros((), device=device))
                continue
            pred = predicted[rows, cols]  # [N, H]
            logits = drafter.logits(pred)  # [N, V'], bfloat16 under bf16 autocast
            token_ce = soft_cross_entropy(logits, target_probs)  # [N], float32
            if not feature_loss_trained:
                feature_loss = torch.zeros((), device=device)
                weights = keep * in_draft_vocab.float()
                soft_ce = (token_ce * weights).sum() / weights.sum().clamp(min=1.0)
                total = total + EAGLE3_STEP_DECAY ** step * soft_ce
            else:
                feature_loss = (F.smooth_l1_loss(pred.float(), goal, reduction="none").mean(-1) * keep).sum() / n
                soft_ce = (token_ce * keep).sum() / n
                total = total + feature_loss + self.soft_ce_weight * soft_ce
            with torch.no_grad():
                best = drafter.to_target_ids(logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).indices)
                hits = (best == greedy[:, None]) & keep.bool()[:, None]  # [N, k], best first
                corrects.append(hits[:, 0].sum().float())
                top_k_hits.append(hits.any(-1).sum().float())
            feature_losses.append(feature_loss.detach())
            soft_ces.append(soft_ce.detach())
            counts.append(torch.tensor(float(n), device=device))
        return ObjectiveOutput(
            loss=total, feature_loss=torch.stack(feature_losses), soft_ce=torch.stack(soft_ces),
            correct=torch.stack(corrects), top_k_hits=torch.stack(top_k_hits), count=torch.stack(counts),
        )


def feature_noise(features: torch.Tensor, lengths: torch.Tensor, scale: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform input noise as EAGLE/HASS add it: `(U - 0.5) * scale * 512 / length`, per sequence.

    Args:
        features: `[B, L, H]`; lengths: `[B]` real lengths; scale: 0.2 in the reference recipe (0 disables).
    """
    if scale == 0:
        return features
    noise = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    amplitude = (scale * 512.0 / lengths.clamp(min=1).float()).to(features.device)[:, None, None]
    return (features.float() + (noise - 0.5) * amplitude).to(features.dtype)
