"""Cache surgery on the target's `DynamicCache` after a verification forward: keep each row's accepted tree nodes,
drop rows that left the batch, re-align rows whose accepted paths differ in length.

Layout. Every layer holds `[B, H_kv, T, D]`; a bool `valid [B, T]` (kept by the tree loop) says which slots each row
attends to. A round writes its tree nodes at slots `past .. past + n - 1`; `keep_accepted` moves each row's accepted
nodes to the slots right after `past` and cuts the cache at `past + W` (`W` the longest path), so a row that accepted
fewer leaves invalid holes. `realign` closes the holes when they grow (one gather per layer).
"""

from __future__ import annotations

import torch

MAX_HOLES = 32  # cache slots beyond the longest row before the rows are re-aligned (attention over holes is cheap)


def has_sliding_window(model) -> bool:
    """Whether the model has sliding-window attention layers (Gemma3's `layer_types`): their window counts slots, so
    their cache is re-aligned after every round (no holes) and tree verification is exact only inside the window."""
    return "sliding_attention" in (getattr(model.config.get_text_config(), "layer_types", None) or [])


def _initialized_layers(cache):
    return [layer for layer in cache.layers
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0]


def _set_states(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = keys.shape[-2]


def keep_accepted(cache, past: int, paths: list[list[int]]) -> None:
    """After a verification forward: keep each row's first `past` slots and move its accepted tree nodes (slots
    `past + path`) to slots `past, past + 1, ...`; the cache ends at `past + W` (`W` the longest path). Only the tree
    slots that move are copied: none when every path is `0, 1, 2, ...` (a root-only or first-child path). `paths`
    holds each row's node indices from the root (0); a shorter path's slots after its end are left as they are (the
    caller masks them)."""
    width = max(len(path) for path in paths)
    # Paths ascend (parents precede children), so slots before the first out-of-place node stay where they are.
    moved = min(next((i for i, node in enumerate(path) if node != i), len(path)) for path in paths)
    if moved < width:
        index = torch.tensor([path[moved:] + list(range(len(path), width)) for path in paths])
        gathers = {}  # one expanded index per layer shape and device, shared by the layers that have it
    for layer in _initialized_layers(cache):
        keys, values = layer.keys, layer.values
        if moved < width:
            shape = (keys.shape[1], keys.shape[-1], keys.device)
            if shape not in gathers:
                gathers[shape] = index.to(keys.device)[:, None, :, None].expand(-1, shape[0], -1, shape[1])
            gather = gathers[shape]
            keys[:, :, past + moved : past + width] = keys[:, :, past:].gather(-2, gather)
            values[:, :, past + moved : past + width] = values[:, :, past:].gather(-2, gather)
        _set_states(layer, keys[:, :, : past + width], values[:, :, : past + width])


def compact_cache(cache, keep: torch.LongTensor | None = None, rows: torch.LongTensor | None = None) -> None:
    """Keep only cache slots `keep` (dim -2) in every layer of a `DynamicCache`: `[B', T']` per row of a batch (None:
    every slot); with `rows` `[B']`, only those batch rows (dim 0), in that order."""
    for layer in _initialized_layers(cache):
        keys, values = layer.keys, layer.values
        if rows is not None:
            keys, values = keys.index_select(0, rows.to(keys.device)), values.index_select(0, rows.to(keys.device))
        if keep is not None:
            index = keep.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            keys, values = keys.gather(-2, index), values.gather(-2, index)
        _set_states(layer, keys, values)


def realign(cache, valid: torch.Tensor) -> torch.Tensor:
    """Move every row's valid slots to the right end, in order, with `T'` = the longest row (one gather per layer);
    returns the new `valid [B', T']`, the left-padded layout."""
    lengths = valid.sum(dim=1)
    width = int(lengths.max())
    # A stable sort on validity lists each row's invalid slots, then its valid ones in order; keep the last `width`.
    order = torch.sort(valid.long(), dim=1, stable=True).indices[:, valid.shape[1] - width :]
    compact_cache(cache, order)
    return torch.arange(width, device=valid.device)[None] >= (width - lengths)[:, None]
