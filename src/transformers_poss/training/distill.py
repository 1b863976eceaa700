"""Self-distillation: answer training conversations with the target itself.

Drafters trained on the target's own answers accept more (EAGLE/HASS practice). A record is a conversation
(`transformers_poss.training.data.RECORD_SHAPES`): its assistant turns are regenerated in place, and the user turns
after its last assistant turn are each answered in order, so a prompts file (conversations of user turns, no answers
yet) gets answered and a full conversation gets its answers replaced. Every answer is generated after the target's own
earlier answers. Records with nothing to answer are skipped and counted by reason (`self_distill`'s
`skipped_by_reason`); when no record is usable, `NoUsableRecordsError` says what shape was expected.

Conversations are processed in chunks of `batch_size`; inside a chunk, answer `k` of every conversation is generated
in one left-padded batch. Each finished chunk is appended to a JSON-lines file (`{"id", "conversations": [ShareGPT
turns]}`) and flushed, so an interrupted run resumes after the last written chunk (records are matched by id).
`distill_server` answers the same records through an OpenAI-compatible server (`answer_steps`, `plan_distillation`).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable

import torch

from .data import RECORD_SHAPES, ConversationFormatError, record_turns

logger = logging.getLogger(__name__)

_SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}

# Why a record is skipped, in the order reports list them (the first three come from `record_turns`).
SKIP_REASONS = {
    "not_a_conversation": "not an object with a 'conversations' or 'messages' list",
    "bad_turn": "a turn that is not an object with text",
    "unknown_role": "a speaker or role that is not system, user or assistant",
    "empty": "no turn with text",
    "no_user_turn": "no user turn with text to answer",
    "prompt_too_long": "the first prompt is longer than max_prompt_length tokens",
}


class NoUsableRecordsError(ValueError):
    """No record of the data can be distilled (and none was distilled before): the message counts the reasons and
    names the record shapes that are read."""


def _record_id(record, index: int) -> str:
    return str(record.get("id", index)) if isinstance(record, dict) else str(index)


def done_ids(path: str) -> set[str]:
    """Ids already written to a distillation output (a truncated last line is ignored)."""
    ids = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    ids.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
    return ids


def distillation_turns(record) -> list[dict]:
    """The chat messages of `record` with one assistant turn wherever an answer is to be generated.

    The record's own assistant turns stay where they are (their text is replaced); every user turn after the last
    assistant turn (all of them in a record of prompts only) gets an empty assistant turn right after it. Leading
    assistant turns answer nothing and are dropped. Raises `ConversationFormatError` with `reason` "empty" or
    "no_user_turn" (or one of `record_turns`' reasons) when the record has nothing to answer.
    """
    messages = record_turns(record)
    if not any(m["content"].strip() for m in messages):
        raise ConversationFormatError("empty", "a conversation with no turn with text")
    start = 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        start += 1
    messages = messages[start:]
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ConversationFormatError("no_user_turn", "a conversation with no user turn (with text) to answer")
    answered = _last_assistant(messages) + 1
    turns = messages[:answered]
    for message in messages[answered:]:
        turns.append(message)
        if message["role"] == "user":
            turns.append({"role": "assistant", "content": ""})
    return turns


def describe_skipped(skipped: dict[str, int]) -> str:
    """`{"no_user_turn": 2, ...}` -> "2 no_user_turn (no user turn to answer), ..." in `SKIP_REASONS` order."""
    order = list(SKIP_REASONS) + sorted(set(skipped) - set(SKIP_REASONS))
    return ", ".join(f"{skipped[r]} {r} ({SKIP_REASONS.get(r, r)})" for r in order if skipped.get(r))


def no_usable_records_message(total: int, skipped: dict[str, int]) -> str:
    found = f"none of the {total} records can be distilled: {describe_skipped(skipped)}" if total else \
        "the data holds no records"
    return (f"{found}. poss distill answers conversations: a JSON array or JSON-lines file (or a datasets id / "
            f"save_to_disk folder) of records like {RECORD_SHAPES}; a record's assistant turns are regenerated and the "
            f"user turns after its last one answered (a prompts file: [{{\"conversations\": [{{\"from\": \"human\", "
            f"\"value\": \"...\"}}]}}, ...])")


def check_records(records: Iterable) -> tuple[int, dict[str, int]]:
    """(usable records, skipped counts by reason) of conversation records, without a tokenizer: what `self_distill`
    would skip except prompts that are too long. Lets a command refuse unusable data before it loads the target."""
    usable, skipped = 0, Counter()
    for record in records:
        try:
            distillation_turns(record)
            usable += 1
        except ConversationFormatError as error:
            skipped[error.reason] += 1
    return usable, dict(skipped)


def _prompt_length(tokenizer, messages: list[dict]) -> int:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def plan_distillation(records: Iterable, tokenizer, output_path: str, max_prompt_length: int):
    """(records to answer as `[(id, distillation_turns)]`, stats) for a run that appends to `output_path`.

    Records already in `output_path` are left out (`skipped_done`), unusable ones and those whose first prompt is
    longer than `max_prompt_length` tokens counted by reason (`skipped_by_reason`, logged). `stats` starts the counts
    `self_distill` returns. Raises `NoUsableRecordsError` when no record is usable and none was written before.
    """
    records = list(records)
    finished = done_ids(output_path)
    todo, skipped, already_done = [], Counter(), 0
    for index, record in enumerate(records):
        rid = _record_id(record, index)
        if rid in finished:
            already_done += 1
            continue
        try:
            turns = distillation_turns(record)
        except ConversationFormatError as error:
            skipped[error.reason] += 1
            continue
        if _prompt_length(tokenizer, turns[: _first_assistant(turns)]) > max_prompt_length:
            skipped["prompt_too_long"] += 1
            continue
        todo.append((rid, turns))
    skipped = dict(skipped)
    if not todo and not already_done:
        raise NoUsableRecordsError(no_usable_records_message(len(records), skipped))
    if skipped:
        logger.warning("self-distillation: skipped %d of %d records: %s", sum(skipped.values()), len(records),
                       describe_skipped(skipped))
    stats = {"records": len(records), "written": 0, "answers": 0, "skipped_done": already_done,
             "skipped_invalid": sum(skipped.values()), "skipped_by_reason": skipped, "generated_tokens": 0}
    return todo, stats


def answer_steps(turns: list[dict], tokenizer, max_prompt_length: int, max_turns: int | None = None):
    """One conversation answered turn by turn, as a generator: it yields `(prompt text, prompt ids)` for each answer
    to generate (the chat template applied to the messages so far, the target's own earlier answers included) and
    is sent that answer's text; it returns the messages up to the last answer.

    A prompt longer than `max_prompt_length` tokens ends the conversation before it (the answers so far stay), and
    so does the `max_turns`-th answer.
    """
    done, rest = [], list(turns)
    while rest:
        while rest and rest[0]["role"] != "assistant":  # copy system/user turns up to the next answer
            done.append(rest.pop(0))
        if not rest:
            break
        rest.pop(0)  # the original answer, replaced below
        prompt = tokenizer.apply_chat_template(done, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            break
        answer = yield prompt, ids
        done.append({"role": "assistant", "content": answer})
        if max_turns is not None and sum(m["role"] == "assistant" for m in done) >= max_turns:
            break
    return done[: _last_assistant(done) + 1]


def advance(steps, answer: str | None):
    """Send `answer` (None to start) to an `answer_steps` generator: `(next prompt, None)` or `(None, messages)`."""
    try:
        return steps.send(answer), None
    except StopIteration as stop:
        return None, stop.value


def open_output(path: str):
    """`path` opened for appending records. A last line cut short by an interruption is ended first, so that the next
    record starts a line of its own (the cut line is skipped on reading, as `done_ids` does)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    out = open(path, "a", encoding="utf-8")
    if out.tell():
        with open(path, "rb") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                out.write("\n")
    return out


def sharegpt_record(rid: str, messages: list[dict]) -> str:
    """One output line: `{"id", "conversations": [ShareGPT turns]}` (no newline)."""
    turns = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]
    return json.dumps({"id": rid, "conversations": turns}, ensure_ascii=False)


@torch.no_grad()
def self_distill(
    target, tokenizer, records: Iterable[dict], output_path: str, batch_size: int = 16, max_new_tokens: int = 512,
    max_prompt_length: int = 2048, do_sample: bool = False, temperature: float = 1.0, progress: bool = True,
    max_turns: int | None = None, drafter=None,
) -> dict:
    """Answer the conversations of `records` with `target` and append them to `output_path` (resumable).

    Each record's assistant turns are regenerated and the user turns after its last assistant turn answered, in
    order, each answer after the target's own earlier ones (`distillation_turns`). With a PosS `drafter` every batch
    is generated speculatively (tree mode on the left-padded batch): the same answers as the target's own batched
    decoding (token for token in fp32, within rounding in 16-bit).

    A record whose first prompt is longer than `max_prompt_length` tokens is skipped; one whose prompt grows past it
    later keeps the turns answered before that point. `max_turns` keeps only the first that many exchanges (later
    turns would lie past a short training `--max-length` anyway, and each costs a prefill of the whole conversation
    so far). Records with nothing to answer are skipped, counted by reason and logged.

    Returns counts: `records`, `written`, `answers` (assistant turns generated), `skipped_done` (records already in
    `output_path`), `skipped_invalid` and `skipped_by_reason` (`SKIP_REASONS` keys), `generated_tokens`.
    Raises `NoUsableRecordsError` (before generating anything) when no record is usable and none was written before.
    """
    if batch_size < 1 or max_new_tokens < 1 or (max_turns is not None and max_turns < 1):
        raise ValueError("batch_size, max_new_tokens and max_turns must be >= 1")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    todo, stats = plan_distillation(records, tokenizer, output_path, max_prompt_length)
    device = next(target.parameters()).device
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="self-distillation", unit="conv")
    try:
        with open_output(output_path) as out:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start: start + batch_size]
                steps = [answer_steps(turns, tokenizer, max_prompt_length, max_turns) for _, turns in chunk]
                results = _regenerate_chunk(target, tokenizer, steps, device, max_new_tokens, do_sample, temperature,
                                            stats, drafter)
                for (rid, _), messages in zip(chunk, results):
                    if not messages:  # cannot happen after the prompt check above; never write an empty record
                        stats["skipped_invalid"] += 1
                        skipped = stats["skipped_by_reason"]
                        skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + 1
                        continue
                    out.write(sharegpt_record(rid, messages) + "\n")
                    stats["written"] += 1
                out.flush()
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        tokenizer.padding_side = padding_side
        if bar is not None:
            bar.close()
    return stats


def _regenerate_chunk(target, tokenizer, steps, device, max_new_tokens, do_sample, temperature, stats,
                      drafter=None) -> list[list[dict]]:
    """Run a few conversations' `answer_steps` together: answer `k` of every conversation in one left-padded batch."""
    results = [None] * len(steps)
    prompts = {}
    for i, conversation in enumerate(steps):
        prompt, results[i] = advance(conversation, None)
        if prompt is not None:
            prompts[i] = prompt[0]
    while prompts:
        owners = list(prompts)
        batch = tokenizer([prompts[i] for i in owners], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(device)
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "assistant_model": drafter}
        if do_sample:
            kwargs["temperature"] = temperature
        output = target.generate(**batch, **kwargs)
        new_tokens = output[:, batch["input_ids"].shape[1]:]
        for row, i in enumerate(owners):
            text = tokenizer.decode(new_tokens[row], skip_special_tokens=True).strip()
            stats["generated_tokens"] += int((new_tokens[row] != tokenizer.pad_token_id).sum())
            stats["answers"] += 1
            prompt, results[i] = advance(steps[i], text)
            if prompt is None:
                del prompts[i]
            else:
                prompts[i] = prompt[0]
    return results


def _first_assistant(messages: list[dict]) -> int:
    return next(index for index, message in enumerate(messages) if message["role"] == "assistant")


def _last_assistant(messages: list[dict]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] == "assistant":
            return index
    return -1
