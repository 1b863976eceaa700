"""Self-distillation through an OpenAI-compatible server (`poss distill --server URL`).

The target's answers come from a server that serves it (`vllm serve`, SGLang, `transformers serve`, ...), many
requests at a time. The records are `self_distill`'s: the same planning and skips (`plan_distillation`), each
conversation answered turn by turn after the target's own earlier answers (`answer_steps`), the same output lines.
They are appended as conversations finish (completion order); a rerun skips the ids already written.

Why `/v1/completions` with the prompt as token ids, not `/v1/chat/completions`. Each prompt is rendered here with the
target's tokenizer and chat template, exactly as `self_distill` renders it, and sent as token ids with `max_tokens`;
the answer's token ids (vLLM's `return_token_ids`) are decoded here as `self_distill` decodes them. Nothing then
depends on the server's own chat template rendering (servers render with their own code and options: default system
prompts, template arguments, a template file given at start) nor on its tokenization of text (a BOS token added in
front of a prompt that already has one): the chat API would leave both to the server. A server that takes text
prompts only (`transformers serve`) gets the rendered text, provided it reads it as the same number of tokens; one
that returns no token ids gives its answer as text.

Before any record is sent, `connect` refuses (`ServerError`) a server that is down, does not speak the API, or serves
another model than the target, as far as the API shows it:
1. `GET /v1/models` answers an OpenAI model list that names the model (`model`, else the only one served); vLLM's
   `max_model_len` is noted.
2. `POST /tokenize` (vLLM's, at the server's root), where offered: the first prompt's text tokenizes into the target
   tokenizer's ids.
3. A 1-token probe completion of the first prompt as token ids, then one of the target's last token id (refused by a
   server with a smaller vocabulary); else of the prompt as text, whose token count (`usage.prompt_tokens`) must be
   the target tokenizer's.
Weights cannot be compared through the API: a model with the target's tokenizer passes. Compare a few answers with
`poss distill` without `--server` (benchmarks/distill-server/measure.py counts the identical ones).

A request that fails (no connection, time-out, HTTP 408/429/5xx, an answer that is not JSON) is retried with
exponential backoff; a record whose request still fails, or is refused (other HTTP 4xx), is counted by reason
(`failed_by_reason`) and not written, so that rerunning the command retries it. When `max(16, 2 * concurrency)`
records in a row fail for want of an answer, the run stops: the rest are counted as `not_attempted`.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from .distill import advance, answer_steps, open_output, plan_distillation, sharegpt_record

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_CHECK_TIMEOUT = 30.0


class ServerError(ValueError):
    """The server cannot answer for the target: it is down, speaks another API, or serves another model."""


class RequestFailed(Exception):
    """One request failed: `reason` is short ("HTTP 503", "no connection", "timed out", "bad response"), `retry`
    whether trying again may help."""

    def __init__(self, reason: str, detail: str, retry: bool):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.retry = reason, detail, retry


class _NotAttempted(Exception):
    """The run stopped before this record was sent."""


class OpenAIClient:
    """JSON calls to an OpenAI-compatible server; `url` is its base, `http://HOST:PORT/v1`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ServerError(f"--server {url!r}: expected the server's OpenAI base URL, like http://HOST:PORT/v1")
        self.url = url.rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        # a proxy set in the environment must not carry requests to this machine's own server
        self.opener = urllib.request.build_opener(
            *([urllib.request.ProxyHandler({})] if parsed.hostname in _LOOPBACK else []))

    def call(self, path: str, body: dict | None = None, timeout: float | None = None, root: bool = False) -> dict:
        """GET (no `body`) or POST `path` under the base URL (or the server's root); the JSON object answered.
        Raises `RequestFailed`."""
        url = (self.root if root else self.url) + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=self.headers, method="GET" if data is None else "POST")
        try:
            with self.opener.open(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            raise RequestFailed(f"HTTP {error.code}", _error_detail(error), error.code in RETRY_STATUS) from None
        except urllib.error.URLError as error:
            timed_out = isinstance(error.reason, TimeoutError)
            raise RequestFailed("timed out" if timed_out else "no connection", f"{url}: {error.reason}", True) from None
        except TimeoutError:
            raise RequestFailed("timed out", f"{url}: no answer in {timeout or self.timeout:g} s", True) from None
        except (OSError, http.client.HTTPException) as error:
            raise RequestFailed("no connection", f"{url}: {error!r}", True) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RequestFailed("bad response", f"{url} answered {raw[:200]!r}, not a JSON object", True)
        return answer


def _error_detail(error: urllib.error.HTTPError) -> str:
    """The server's own message of an HTTP error (OpenAI's `{"error": {"message"}}`, FastAPI's `{"detail"}`)."""
    try:
        raw = error.read()
    except OSError:
        raw = b""
    try:
        body = json.loads(raw)
        message = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(message, dict):
            message = message.get("message") or message.get("detail") or message
        return str(message)[:500]
    except ValueError:
        return raw.decode(errors="replace").strip()[:500] or str(error.reason)


def _choice(answer: dict) -> dict:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
            or not isinstance(choices[0].get("text"), str):
        raise RequestFailed("bad response", f"a completion without choices[0].text: {str(answer)[:200]}", True)
    return choices[0]


@dataclass
class ServedTarget:
    """A server checked to serve the target (`connect`): how to send it prompts, and what was checked."""

    client: OpenAIClient
    model: str
    token_ids: bool  # prompts go as token ids (else as text)
    return_token_ids: bool  # answers come back as token ids too
    checks: list[str] = field(default_factory=list)

    def complete(self, prompt: str, ids: list[int], max_tokens: int, temperature: float) -> tuple:
        """`(answer token ids or None, answer text, the server's count of answer tokens or None)` of one prompt
        (`prompt` rendered by the chat template, `ids` its token ids). Raises `RequestFailed`."""
        body = {"model": self.model, "prompt": ids if self.token_ids else prompt, "max_tokens": max_tokens,
                "temperature": temperature}
        if self.return_token_ids:
            body["return_token_ids"] = True
        answer = self.client.call("/completions", body)
        choice = _choice(answer)
        token_ids = choice.get("token_ids") if self.return_token_ids else None
        if self.return_token_ids and not (isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids)):
            raise RequestFailed("bad response", f"a completion without token_ids: {str(answer)[:200]}", True)
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        return token_ids, choice["text"], usage.get("completion_tokens")


def connect(url: str, tokenizer, prompt: str, ids: list[int], model: str | None = None, api_key: str | None = None,
            timeout: float = 600.0, max_length: int | None = None) -> ServedTarget:
    """Check that the server at `url` serves the target whose tokenizer is `tokenizer`, probing with one prompt
    (`prompt` rendered by the chat template, `ids` its token ids), and choose how prompts are sent (module docstring).
    `max_length`: the longest prompt plus answer a run asks for (a smaller vLLM `max_model_len` is noted).
    Raises `ServerError` naming what failed; `ServedTarget.checks` says what was checked."""
    client = OpenAIClient(url, api_key, timeout)
    try:
        listing = client.call("/models", timeout=_CHECK_TIMEOUT)
    except RequestFailed as error:
        if error.reason in ("no connection", "timed out"):
            raise ServerError(f"cannot reach a server at {client.url} ({error}). Start the server first (e.g. `vllm "
                              "serve MODEL`) and pass its OpenAI base URL, http://HOST:PORT/v1") from None
        if error.reason in ("HTTP 401", "HTTP 403"):
            raise ServerError(f"{client.url} refused the request ({error}): a server started with an API key needs "
                              "it (--api-key)") from None
        raise ServerError(f"{client.url} does not speak the OpenAI API: GET {client.url}/models answered {error}") \
            from None
    served = listing.get("data")
    if not isinstance(served, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in served):
        raise ServerError(f"{client.url} does not speak the OpenAI API: GET {client.url}/models answered no model "
                          f"list ({str(listing)[:200]})")
    names = [entry["id"] for entry in served]
    if model is None:
        if len(names) != 1:
            raise ServerError(f"{client.url} serves {names or 'no model'}: name the target's with --model")
        model = names[0]
    elif model not in names:
        raise ServerError(f"{client.url} does not serve --model {model!r}; it serves {names}")
    entry = served[names.index(model)]
    checks = [f"GET /v1/models: serves {model!r}"]
    context = entry.get("max_model_len")
    if isinstance(context, int):
        checks[0] += f" (max_model_len {context})"
        if max_length is not None and context < max_length:
            checks.append(f"max_model_len {context} < --max-prompt-length + --max-new-tokens = {max_length}: the "
                          "server cuts or refuses the longest requests (refusals are counted as failed)")
    checks.append(_check_tokenize(client, model, prompt, ids))
    served_target = _probe(client, model, tokenizer, prompt, ids)
    served_target.checks = checks + served_target.checks
    return served_target


def _check_tokenize(client: OpenAIClient, model: str, prompt: str, ids: list[int]) -> str:
    try:
        answer = client.call("/tokenize", {"model": model, "prompt": prompt, "add_special_tokens": False},
                             timeout=_CHECK_TIMEOUT, root=True)
    except RequestFailed as error:
        return f"POST /tokenize: not offered ({error.reason}), not checked"
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        return "POST /tokenize: answered no token list, not checked"
    if tokens != ids:
        at = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
        raise ServerError(
            f"{model!r} at {client.url} has another tokenizer than the target: the first prompt is {len(tokens)} "
            f"tokens there, {len(ids)} with the target's tokenizer, first different at token {at} (server "
            f"{tokens[at: at + 3]}, target {ids[at: at + 3]}). Serve the target (or pass its tokenizer, --tokenizer)")
    return f"POST /tokenize: the first prompt's {len(ids)} token ids equal the target tokenizer's"


def _probe(client: OpenAIClient, model: str, tokenizer, prompt: str, ids: list[int]) -> ServedTarget:
    """One-token completions: as token ids (asking for answer ids, then not), else as text; then the vocabulary."""
    base = {"model": model, "max_tokens": 1, "temperature": 0}
    tries = [(True, True), (True, False), (False, False)]  # (prompt as token ids, answer token ids asked for)
    refusals = []
    for as_ids, with_ids in tries:
        body = {**base, "prompt": ids if as_ids else prompt, **({"return_token_ids": True} if with_ids else {})}
        try:
            answer = client.call("/completions", body)
            choice = _choice(answer)
        except RequestFailed as error:
            if error.retry:
                raise ServerError(f"the probe completion at {client.url}/completions failed ({error})") from None
            refusals.append(f"{'token ids' if as_ids else 'text'}: {error}")
            continue
        break
    else:
        raise ServerError(f"{client.url}/completions refused a one-token probe of {model!r} ("
                          + "; ".join(refusals) + "): not an OpenAI completions API serving it")
    returns_ids = with_ids and isinstance(choice.get("token_ids"), list)
    served = ServedTarget(client, model, as_ids, returns_ids)
    if as_ids:
        last = len(tokenizer) - 1
        try:
            client.call("/completions", {**base, "prompt": [last]})
        except RequestFailed as error:
            if error.retry:
                raise ServerError(f"the probe completion at {client.url}/completions failed ({error})") from None
            raise ServerError(f"{model!r} at {client.url} refuses the target's last token id {last} ({error}): its "
                              "vocabulary is smaller than the target's, another model") from None
        served.checks.append(f"probe: prompts as token ids, the target's last token id {last} accepted; answers as "
                             + ("token ids" if returns_ids else "text (no token_ids returned)"))
        return served
    counted = answer.get("usage", {}).get("prompt_tokens") if isinstance(answer.get("usage"), dict) else None
    if counted is None:
        served.checks.append(f"probe: prompts as text (token ids refused: {refusals[0]}); the server reports no "
                             "prompt token count, the tokenization is not checked")
    elif counted != len(ids):
        raise ServerError(f"{model!r} at {client.url} reads the first prompt as {counted} tokens, the target's "
                          f"tokenizer as {len(ids)}: another tokenizer, or special tokens added to a text prompt "
                          "(such a server cannot give the target's answers; serve it with vLLM, which takes token ids)")
    else:
        served.checks.append(f"probe: prompts as text (token ids refused: {refusals[0]}), read as the target "
                             f"tokenizer's {counted} tokens")
    return served


def server_distill(
    tokenizer, records, output_path: str, url: str, model: str | None = None, concurrency: int = 16,
    max_new_tokens: int = 512, max_prompt_length: int = 2048, temperature: float = 0.0, max_turns: int | None = None,
    retries: int = 4, retry_wait: float = 1.0, timeout: float = 600.0, api_key: str | None = None,
    progress: bool = True,
) -> dict:
    """`self_distill`'s records answered by the server at `url` (`concurrency` conversations at a time), appended to
    `output_path` (resumable). `tokenizer` is the target's; `temperature` 0 is greedy.

    Returns `self_distill`'s counts plus `failed`, `failed_by_reason`, `not_attempted` and `server` (url, model, how
    prompts are sent, `checks`); `stopped` says why the run stopped early, if it did. `generated_tokens` counts the
    answers' token ids as `self_distill` does (padding and end-of-turn ids excluded) or, from a server that returns no
    ids, the server's `usage.completion_tokens`. Raises `NoUsableRecordsError`
    before contacting the server when no record is usable, `ServerError` before sending any record when the server
    cannot answer for the target (`connect`).
    """
    if min(concurrency, max_new_tokens, 1 if max_turns is None else max_turns) < 1 or retries < 0 or not timeout > 0:
        raise ValueError("concurrency, max_new_tokens and max_turns must be >= 1, retries >= 0, timeout > 0")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    todo, stats = plan_distillation(records, tokenizer, output_path, max_prompt_length)
    stats.update(failed=0, failed_by_reason={}, not_attempted=0)
    if not todo:
        return stats
    first, _ = advance(answer_steps(todo[0][1], tokenizer, max_prompt_length), None)
    served = connect(url, tokenizer, *first, model=model, api_key=api_key, timeout=timeout,
                     max_length=max_prompt_length + max_new_tokens)
    stats["server"] = {"url": served.client.url, "model": served.model,
                       "prompts": "token ids" if served.token_ids else "text", "checks": served.checks}
    for check in served.checks:
        logger.info("server check: %s", check)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    lock, stop = threading.Lock(), threading.Event()  # the tokenizer is used by one thread at a time

    def request(prompt, ids):
        for attempt in range(retries + 1):
            try:
                return served.complete(prompt, ids, max_new_tokens, temperature)
            except RequestFailed as error:
                if not error.retry or attempt == retries or stop.wait(retry_wait * 2 ** attempt):
                    raise

    def answer_conversation(turns):
        if stop.is_set():
            raise _NotAttempted
        with lock:
            steps = answer_steps(turns, tokenizer, max_prompt_length, max_turns)
            prompt, messages = advance(steps, None)
        answers = tokens = 0
        while prompt is not None:
            token_ids, text, counted = request(*prompt)
            with lock:
                if token_ids is not None:
                    text, counted = tokenizer.decode(token_ids, skip_special_tokens=True), \
                        sum(t != pad_id for t in token_ids)
                elif counted is None:
                    counted = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                prompt, messages = advance(steps, text.strip())
            answers, tokens = answers + 1, tokens + counted
        return messages, answers, tokens

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="self-distillation (server)", unit="conv")
    failed, in_a_row, limit = Counter(), 0, max(16, 2 * concurrency)
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="poss-distill")
    try:
        futures = {pool.submit(answer_conversation, turns): rid for rid, turns in todo}
        with open_output(output_path) as out:
            for future in as_completed(futures):
                rid = futures[future]
                try:
                    messages, answers, tokens = future.result()
                except _NotAttempted:
                    stats["not_attempted"] += 1
                    continue
                except RequestFailed as error:
                    if not failed[error.reason]:
                        logger.warning("self-distillation: record %s failed (%d retries): %s", rid, retries, error)
                    failed[error.reason] += 1
                    in_a_row = in_a_row + 1 if error.retry else 0
                    if in_a_row >= limit and not stop.is_set():
                        stop.set()
                        stats["stopped"] = (f"{in_a_row} records in a row got no answer from the server (last: "
                                            f"{error}): stopped")
                        logger.error("self-distillation: %s", stats["stopped"])
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(failed=sum(failed.values()))
                    continue
                in_a_row = 0
                out.write(sharegpt_record(rid, messages) + "\n")
                out.flush()
                stats["written"] += 1
                stats["answers"] += answers
                stats["generated_tokens"] += tokens
                if bar is not None:
                    bar.update(1)
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)  # requests in flight after an error are not waited for
        if bar is not None:
            bar.close()
    stats["failed"], stats["failed_by_reason"] = sum(failed.values()), dict(failed)
    return stats


def describe_failures(stats: dict) -> str:
    """What a run left unwritten, for its error message ("" when nothing was)."""
    parts = []
    if stats.get("failed"):
        reasons = ", ".join(f"{count} {reason}" for reason, count in stats["failed_by_reason"].items())
        parts.append(f"{stats['failed']} records failed ({reasons})")
    if stats.get("not_attempted"):
        parts.append(f"{stats['not_attempted']} were not sent ({stats.get('stopped', 'the run stopped')})")
    if not parts:
        return ""
    return (" and ".join(parts) + f"; the {stats['written']} records answered are written: rerun the same command to "
            "retry the rest")
