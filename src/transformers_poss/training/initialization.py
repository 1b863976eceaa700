"""The drafter before training: built for the target, warm-started from a trained drafter (`--init-from`), with a
draft vocabulary of the training data's most frequent assistant tokens (`--draft-vocab-size`), or the source's kept
or grown."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..lora import load_shared_layer
from ..configuration_poss import DRAFTER_CONFIGS
from ..modeling_poss import PosSDrafter
from .arguments import TrainingArguments


def build_drafter(args: TrainingArguments, target, feature_layers: list[int] | None = None,
                  token_examples: Iterable[dict] | None = None) -> tuple[PosSDrafter, dict]:
    """A new drafter for `target` (seeded by `args.seed`) reading the target hidden states `feature_layers`,
    warm-started from `args.init_from`, with the drafting budget of `args` in its `generation_config`.

    With `args.draft_vocab_size` and `token_examples` (`{"input_ids", "loss_mask"}` of the training split), the draft
    vocabulary is their most frequent assistant tokens, unless the warm start copies or grows the source's.
    Returns (drafter, record of the initialisation: `init_from`, `draft_vocab`)."""
    torch.manual_seed(args.seed)
    kind = DRAFTER_CONFIGS[args.drafter_type]
    kind_settings = {"feature_layers": kind.feature_layers_of(feature_layers), "fc_bias": args.fc_bias}
    if args.norm_before_residual:  # an EAGLE-3 setting (the arguments refuse it for other kinds)
        kind_settings["norm_before_residual"] = True
    drafter = PosSDrafter.from_target(
        target, num_specialists=args.specialist_count(), positions_per_specialist=args.positions_per_specialist,
        position_groups=args.position_group_list(), lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        draft_vocab_size=args.draft_vocab_size, draft_head_rows=args.draft_head_rows, drafter_type=args.drafter_type,
        tree_depth=args.tree_depth, tree_top_k=args.tree_top_k, tree_total_tokens=args.tree_total_tokens,
        **kind_settings,
    )
    counts = None
    if args.draft_vocab_size is not None and token_examples is not None:
        counts = count_token_frequencies(token_examples, drafter.config.vocab_size)
    record = {}
    if args.init_from:
        record["init_from"] = warm_start(drafter, args.init_from, token_counts=counts, target=target)
    if counts is not None:
        copied = record.get("init_from", {}).get("draft_vocab_copied", False)
        grown = record.get("init_from", {}).get("draft_vocab_grown_from") is not None
        if not copied:
            drafter.init_draft_vocab(top_token_ids(counts, args.draft_vocab_size),
                                     target.get_output_embeddings().weight)
        source = ("init_from's, grown by the most frequent assistant tokens of the training split" if grown
                  else "init_from" if copied else "most frequent assistant tokens of the training split")
        record["draft_vocab"] = {"size": args.draft_vocab_size, "own_head_rows": drafter.config.own_draft_head_rows,
                                 "from": source,
                                 "coverage": draft_vocab_coverage(counts, drafter.draft_to_target.cpu())}
    return drafter, record


def warm_start(drafter: PosSDrafter, source: PosSDrafter | str, token_counts: torch.Tensor | None = None,
               target=None) -> dict:
    """Initialise `drafter` from a trained drafter: its `fc`, and its layer `min(i, n_source - 1)` into specialist
    `i` (a single-specialist EAGLE/HASS drafter goes into every specialist); its draft vocabulary and head too when
    both use one of the same size and layout (`draft_head_rows`), or grown (`grow_draft_vocab`) when this drafter's
    is larger, the source's head stores all its rows and `token_counts` `[V]` of the training data and the `target`
    (whose `lm_head` rows the new tokens start from) are given; its
    `fuse` when both read the same target layers (otherwise `fuse` keeps its initialisation, which passes the final
    hidden state through, so a last-layer-only source starts a fused drafter exactly where it stands).
    With LoRA specialists (`lora_rank`), the source's first layer becomes the shared layer and the adapters start
    at zero, so the drafter starts where that layer stands. Returns what was copied. Raises `ValueError` for drafters
    of another shape."""
    if isinstance(source, str):
        source = PosSDrafter.from_pretrained(source)
    source = source.merged()  # a source with LoRA specialists starts others as its full layers would
    mine, theirs = drafter.config.target_config, source.config.target_config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size"):
        if mine.get(key) != theirs.get(key):
            raise ValueError(f"cannot warm start: the source drafter has {key}={theirs.get(key)!r}, "
                             f"this one {mine.get(key)!r}")
    if drafter.config.fc_bias != source.config.fc_bias:
        raise ValueError("cannot warm start: fc_bias differs between the drafters")
    if type(drafter) is not type(source):
        raise ValueError(f"cannot warm start a {drafter.config.drafter_type} drafter from a "
                         f"{source.config.drafter_type} one: their layers differ")
    if drafter.fuse is None and drafter.config.num_fused_states > 1 and \
            drafter.config.feature_layers != source.config.feature_layers:  # fc itself fuses (EAGLE-3)
        raise ValueError("cannot warm start: the drafters fuse different target states")
    with torch.no_grad():
        drafter.fc.load_state_dict(source.fc.state_dict())
        if drafter.norm is not None:  # EAGLE-3's final norm
            drafter.norm.load_state_dict(source.norm.state_dict())
        n_source = len(source.specialists)
        if drafter.config.lora_rank is not None:  # the shared layer starts as the source's first; adapters at zero
            load_shared_layer(drafter.specialists, source.specialists[0].state_dict())
        else:
            for i, layer in enumerate(drafter.specialists):
                layer.load_state_dict(source.specialists[min(i, n_source - 1)].state_dict())
        copied_vocab, grown_from = False, None
        if drafter.draft_lm_head is not None and source.draft_lm_head is not None:
            mine, theirs = drafter.config, source.config
            same_head = (mine.draft_vocab_size, mine.own_draft_head_rows) == (theirs.draft_vocab_size,
                                                                               theirs.own_draft_head_rows)
            if same_head:
                drafter.draft_lm_head.load_state_dict(source.draft_lm_head.state_dict())
                if drafter.draft_head_map is not None:
                    drafter.draft_head_map.load_state_dict(source.draft_head_map.state_dict())
                drafter.draft_to_target.copy_(source.draft_to_target)
            elif (token_counts is not None and target is not None and source.draft_head_map is None
                  and mine.draft_vocab_size > theirs.draft_vocab_size):
                grow_draft_vocab(drafter, source, token_counts, target)
                grown_from = theirs.draft_vocab_size
            copied_vocab = same_head or grown_from is not None
        copied_fuse = (drafter.fuse is not None and source.fuse is not None
                       and drafter.config.input_feature_layers == source.config.input_feature_layers)
        if copied_fuse:
            drafter.fuse.load_state_dict(source.fuse.state_dict())
    return {"source": source.config.name_or_path or "in-memory drafter", "source_specialists": n_source,
            "draft_vocab_copied": copied_vocab, "draft_vocab_grown_from": grown_from,
            "fuse_copied": copied_fuse,
            "source_feature_layers": source.config.input_feature_layers}


# ---- draft vocabulary ----------------------------------------------------------------------------------------
def grow_draft_vocab(drafter: PosSDrafter, source: PosSDrafter, token_counts: torch.Tensor, target) -> None:
    """Give `drafter` (draft vocabulary `Vd`, for `target`) the source's smaller draft vocabulary `[Vs]` first, then the
    `Vd - Vs` tokens most frequent in `token_counts` `[V]` (ties: lower id) that the source lacks.

    A trained head drifts from the target's `lm_head` rows it started from, so the new tokens' rows are the
    target's rows carried through the least-squares affine map that takes the source's tokens' target rows to its
    trained rows. The drafter's own head (its first `R = config.draft_head_rows` rows) gets the source's trained rows,
    then such mapped rows; that map becomes `draft_head_map` for the tokens after `R`. With `R >= Vs` the source's
    logits over its own tokens are unchanged; with `R < Vs` its tokens after `R` get mapped rows instead."""
    source_ids = source.draft_to_target.to(token_counts.device)
    rest = token_counts.clone()
    rest[source_ids] = -1
    new_ids = top_token_ids(rest, drafter.config.draft_vocab_size - len(source_ids))
    target_rows = target.get_output_embeddings().weight.detach().float().cpu()
    source_rows = source.draft_lm_head.weight.detach().float().cpu()

    def with_bias(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat((rows, torch.ones(len(rows), 1)), dim=1)

    affine = torch.linalg.lstsq(with_bias(target_rows[source_ids.cpu()]), source_rows).solution  # [H + 1, H]
    own = drafter.config.own_draft_head_rows
    new_own_rows = with_bias(target_rows[new_ids[: max(own - len(source_ids), 0)].cpu()]) @ affine
    with torch.no_grad():
        drafter.draft_to_target.copy_(torch.cat((source_ids.cpu(), new_ids.cpu())))
        drafter.draft_lm_head.weight.copy_(torch.cat((source_rows[:own], new_own_rows)))
        if drafter.draft_head_map is not None:  # rows @ A + c = logits E @ (A @ f) + c . f: the map's [A; c]
            drafter.draft_head_map.weight.copy_(affine)


def count_token_frequencies(examples: Iterable[dict], vocab_size: int, assistant_only: bool = True) -> torch.Tensor:
    """Token counts `[vocab_size]` (int64) over examples' `input_ids` (only loss-masked tokens by default)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for example in examples:
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
        if assistant_only:
            ids = ids[torch.as_tensor(example["loss_mask"], dtype=torch.bool)]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def top_token_ids(counts: torch.Tensor, size: int) -> torch.LongTensor:
    """The `size` most frequent token ids `[size]`, most frequent first (ties: lower id first)."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].clone()


def draft_vocab_coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Fraction of counted tokens inside the draft vocabulary `ids`."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else float("nan")
