"""Self-distillation: regenerate the assistant turns of training conversations with the target itself.

Drafters trained on the target's own answers accept more (EAGLE/HASS practice). Conversations are processed in
chunks of `batch_size`; inside a chunk, turn `k` of every conversation is generated in one left-padded batch, with
the earlier turns already replaced by the target's answers. Each finished chunk is appended to a JSON-lines file
(`{"id", "conversations": [ShareGPT turns]}`) and flushed, so an interrupted run resumes after the last written
chunk (records are matched by id).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from .data import to_messages

_SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def _record_id(record: dict, index: int) -> str:
    return str(record.get("id", index))


def done_ids(path: str) -> set[str]:
    """Ids already written to a distillation output (a truncated last line is ignored)."""
    ids = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    ids.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError):
                    continue
    return ids


@torch.no_grad()
def self_distill(
    target, tokenizer, records: Sequence[dict], output_path: str, batch_size: int = 16, max_new_tokens: int = 512,
    max_prompt_length: int = 2048, do_sample: bool = False, temperature: float = 1.0, progress: bool = True,
    max_turns: int | None = None, drafter=None,
) -> dict:
    """Regenerate assistant turns with `target` and append the conversations to `output_path` (resumable).

    With a PosS `drafter` every batch is generated speculatively (tree mode on the left-padded batch): the same
    answers as the target's own batched decoding (token for token in fp32, within rounding in 16-bit).

    A conversation whose prompt grows past `max_prompt_length` tokens keeps the turns generated before that point;
    `max_turns` keeps only the first that many exchanges (later turns would lie past a short training
    `--max-length` anyway, and each costs a prefill of the whole conversation so far).
    Returns counts: `written`, `skipped_done`, `skipped_invalid`, `generated_tokens`.
    """
    if batch_size < 1 or max_new_tokens < 1 or (max_turns is not None and max_turns < 1):
        raise ValueError("batch_size, max_new_tokens and max_turns must be >= 1")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    finished = done_ids(output_path)
    todo, invalid = [], 0
    for index, record in enumerate(records):
        rid = _record_id(record, index)
        if rid in finished:
            continue
        try:
            messages = to_messages(record)
        except ValueError:
            invalid += 1
            continue
        if any(m["role"] == "assistant" for m in messages):
            todo.append((rid, messages))
        else:
            invalid += 1
    stats = {"written": 0, "skipped_done": len(finished), "skipped_invalid": invalid, "generated_tokens": 0}
    device = next(target.parameters()).device
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="self-distillation", unit="conv")
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    try:
        with open(output_path, "a", encoding="utf-8") as out:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start: start + batch_size]
                results = _regenerate_chunk(target, tokenizer, [m for _, m in chunk], device, max_new_tokens,
                                            max_prompt_length, do_sample, temperature, stats, max_turns, drafter)
                for (rid, _), messages in zip(chunk, results):
                    turns = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]
                    out.write(json.dumps({"id": rid, "conversations": turns}, ensure_ascii=False) + "\n")
                    stats["written"] += 1
                out.flush()
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        tokenizer.padding_side = padding_side
        if bar is not None:
            bar.close()
    return stats


def _regenerate_chunk(target, tokenizer, conversations, device, max_new_tokens, max_prompt_length, do_sample,
                      temperature, stats, max_turns=None, drafter=None) -> list[list[dict]]:
    """Regenerate every assistant turn of a few conversations, turn index by turn index, in batches."""
    # Work list per conversation: its messages up to now (assistant turns regenerated), the original remainder.
    done = [[] for _ in conversations]
    rest = [list(m) for m in conversations]
    active = list(range(len(conversations)))
    while active:
        prompts, owners = [], []
        for i in active:
            while rest[i] and rest[i][0]["role"] != "assistant":  # copy system/user turns up to the next answer
                done[i].append(rest[i].pop(0))
            if not rest[i]:
                continue
            rest[i].pop(0)  # the original answer, replaced below
            prompt = tokenizer.apply_chat_template(done[i], tokenize=False, add_generation_prompt=True)
            if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > max_prompt_length:
                rest[i] = []
                done[i] = done[i][: _last_assistant(done[i]) + 1]
                continue
            prompts.append(prompt)
            owners.append(i)
        if not prompts:
            break
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "assistant_model": drafter}
        if do_sample:
            kwargs["temperature"] = temperature
        output = target.generate(**batch, **kwargs)
        new_tokens = output[:, batch["input_ids"].shape[1]:]
        for row, i in enumerate(owners):
            text = tokenizer.decode(new_tokens[row], skip_special_tokens=True).strip()
            stats["generated_tokens"] += int((new_tokens[row] != tokenizer.pad_token_id).sum())
            done[i].append({"role": "assistant", "content": text})
            if max_turns is not None and sum(m["role"] == "assistant" for m in done[i]) >= max_turns:
                rest[i] = []
        active = [i for i in owners if rest[i]]
    return [d[: _last_assistant(d) + 1] for d in done]


def _last_assistant(messages: list[dict]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] == "assistant":
            return index
    return -1
