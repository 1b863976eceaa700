"""Verification: the target forward over a round's draft trees, and the target's logits at their nodes.

The trees of a round (one per row) are padded to the largest and sent as one `[B, n]` query with a 4D additive mask:
row b's real nodes see its valid context slots, their ancestors and themselves; padding nodes see themselves only
and are never accepted. Positions are each row's count of valid slots plus the node's depth.
"""

from __future__ import annotations

import torch

from ..layers import additive_mask, output_logits
from .drafting import DraftTree


def keeps_every_tree_row(model) -> bool:
    """Whether verification projects every tree node through the `lm_head` in its forward (one pass over the head).

    The alternative is `TreeLogits` projecting the rows acceptance visits one at a time (about tau of them). In
    16-bit and on accelerators reading the head's weights dominates, so one pass over every row costs little more
    than one row; in fp32 on a CPU each row adds more, and visiting only the accepted path's rows is cheaper at the
    acceptance lengths CPU drafters reach (`benchmarks/scripts/verify_cost.py --lm-head` times both).
    """
    return model.device.type != "cpu" or model.dtype in (torch.bfloat16, torch.float16)


def logits_to_keep(model, keep) -> dict:
    """`logits_to_keep` (an int: the last n positions; a 1D tensor: these positions) where the model takes it."""
    return {"logits_to_keep": keep} if model._supports_logits_to_keep() else {}


def verification_rows(model, device):
    """What verification forwards keep as `logits_to_keep`: every row (0) or none (`TreeLogits` projects them)."""
    return 0 if keeps_every_tree_row(model) else torch.empty(0, dtype=torch.long, device=device)


def padded_trees(trees: list[DraftTree], valid: torch.Tensor):
    """The trees of a round padded to the largest, `n` nodes each, over a cache whose slots `valid [B, T]` says.

    Returns tokens `[B, n]`, depths `[B, n]` and the bool attention pattern `[B, n, T + n]` (True = attend).
    """
    n = max(len(tree) for tree in trees)
    if len(trees) == 1 and bool(valid.all()):  # one prompt: no padding, the whole past visible
        tree = trees[0]
        context = torch.ones(1, n, valid.shape[1], dtype=torch.bool, device=valid.device)
        return tree.tokens[None], tree.depths[None], torch.cat((context, tree.visible[None].to(valid.device)), dim=2)
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    depths = torch.zeros(len(trees), n, dtype=torch.long)
    visible = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)  # [B, n, n]
    real = torch.zeros(len(trees), n, dtype=torch.bool)
    for i, tree in enumerate(trees):
        size = len(tree)
        tokens[i, :size], depths[i, :size] = tree.tokens.cpu(), tree.depths.cpu()
        visible[i, :size, :size] = tree.visible.cpu()
        real[i, :size] = True
    context = valid[:, None, :] & real.to(valid.device)[:, :, None]  # [B, n, T]
    return tokens, depths, torch.cat((context, visible.to(valid.device)), dim=2)


def tree_attention_mask(model, tree: DraftTree, past: int, device):
    """The 4D additive float mask `[1, 1, n, past + n]` of one tree over `past` visible slots (or Gemma3's dict)."""
    allowed = torch.cat((torch.ones(len(tree), past, dtype=torch.bool, device=tree.visible.device), tree.visible), 1)
    return attention_mask_for(model, allowed[None].to(device))


def attention_mask_for(model, allowed: torch.Tensor):
    """Bool pattern `[B, q, k]` (True = attend) -> the 4D additive float mask `[B, 1, q, k]` the model takes as is
    (right for eager and sdpa), or Gemma3's per-layer-type dict of it."""
    mask = additive_mask(allowed, model.dtype)[0, 0][:, None]
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if layer_types:
        return {layer_type: mask for layer_type in set(layer_types)}
    return mask


class TreeLogits:
    """Target logits of tree nodes: all of them from the forward, or projected only for the nodes acceptance visits.

    In fp32 on a CPU (see `keeps_every_tree_row`) the verification forward keeps no logits where the model takes
    `logits_to_keep`; `raw(i)` then projects node `i`'s last hidden state `[H]` through the target's output
    embeddings (and Gemma's final soft-capping) on first use. Acceptance walks one root path, so about tau rows of
    `[V]` are projected instead of one per tree node. `self[i]` applies generate's logits processors with the
    node's own prefix (the sequence up to that node).
    """

    def __init__(self, model, hidden: torch.Tensor, logits: torch.Tensor, tree: DraftTree, input_ids,
                 logits_processor):
        self.model, self.hidden, self.tree = model, hidden, tree
        self.full_logits = logits if logits.shape[0] == len(tree) else None  # [n, V] when the model kept them all
        self.input_ids, self.logits_processor = input_ids, logits_processor
        self._raw: dict[int, torch.Tensor] = {}
        self._processed: dict[int, torch.Tensor] = {}

    def raw(self, node: int) -> torch.Tensor:
        """Unprocessed float32 logits `[V]` of `node`."""
        if node not in self._raw:
            if self.full_logits is not None:
                row = self.full_logits[node]
            else:
                row = output_logits(self.model, self.hidden[node : node + 1])[0]
            self._raw[node] = row.to(dtype=torch.float32, device=self.input_ids.device)
        return self._raw[node]

    def __getitem__(self, node: int) -> torch.Tensor:
        """Processed logits `[V]` of `node`."""
        if node not in self._processed:
            row = self.raw(node)
            if self.logits_processor:
                prefix = torch.cat((self.input_ids, self._path_tokens(node)[None]), dim=1)
                row = self.logits_processor(prefix, row[None].clone())[0]
            self._processed[node] = row
        return self._processed[node]

    def _path_tokens(self, node: int) -> torch.LongTensor:
        """Tokens `[depth]` from the root's child down to `node`."""
        parents = self.tree.parents.tolist()
        path = []
        while node > 0:
            path.append(node)
            node = parents[node]
        return self.tree.tokens[path[::-1]].to(self.input_ids.device)
