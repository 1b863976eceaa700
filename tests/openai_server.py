"""A small OpenAI-compatible server on the loopback for tests: a tiny target answers with its own `generate`.

It speaks what `poss distill --server` uses, as vLLM does: `GET /v1/models` (with `max_model_len`), `POST
/v1/completions` (a prompt of token ids or text, `max_tokens`, `temperature`, `return_token_ids`) and `POST /tokenize`
at the root. Options make it behave like other servers (text prompts only and no `/tokenize`, as `transformers serve`)
or misbehave (failing requests, another API).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeOpenAIServer:
    """`with FakeOpenAIServer(target, tokenizer) as server:` serves `target` at `server.url` (http://127.0.0.1:PORT/v1).

    Args:
        model: the served model's name.
        token_ids: take prompts as token ids and return answers' `token_ids` when asked (vLLM); else text prompts
            only, tokenized with the tokenizer's special tokens, and unknown request fields refused (as transformers
            serve does).
        tokenize: offer `POST /tokenize` (vLLM).
        vocab_size: token ids at or above it are refused (default: the tokenizer's or the target's, the smaller).
        fail: `fail(prompt_text, attempt) -> HTTP status or None`, asked for every answering request (`max_tokens`
            > 1; `attempt` counts that prompt's requests from 1): a status answers the request with that error.
        delay: seconds each answering request waits before generating (so that concurrent requests overlap).
        api: "openai", or "other" (404 everywhere) / "html" (200 with an HTML page everywhere).
        api_key: when given, requests without `Authorization: Bearer <api_key>` are answered 401.

    `completions` lists the answered prompts (token ids) in order, `max_in_flight` the most requests at once.
    """

    def __init__(self, target, tokenizer, model: str = "tiny-target", token_ids: bool = True, tokenize: bool = True,
                 vocab_size: int | None = None, fail=None, delay: float = 0.0, api: str = "openai",
                 max_model_len: int = 4096, api_key: str | None = None):
        self.target, self.tokenizer, self.model = target, tokenizer, model
        self.token_ids, self.tokenize, self.fail, self.delay, self.api = token_ids, tokenize, fail, delay, api
        self.vocab_size = min(len(tokenizer), target.config.vocab_size) if vocab_size is None else vocab_size
        self.max_model_len, self.api_key = max_model_len, api_key
        self.completions: list[list[int]] = []
        self.attempts: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self._lock, self._generate_lock = threading.Lock(), threading.Lock()
        self._httpd = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAIServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server._route(self, "GET")

            def do_POST(self):
                server._route(self, "POST")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---- requests ----
    def _route(self, handler, method: str):
        if self.api == "other":
            return _send(handler, 404, b"<html><body>Not Found</body></html>", "text/html")
        if self.api == "html":
            return _send(handler, 200, b"<html><body>Welcome</body></html>", "text/html")
        if self.api_key and handler.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(handler, 401, "Unauthorized")
        path = handler.path.split("?")[0]
        body = None
        if method == "POST":
            try:
                body = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", 0))))
            except ValueError:
                return _error(handler, 400, "the body is not JSON")
        if (method, path) == ("GET", "/v1/models"):
            return _json(handler, 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "tests", "max_model_len": self.max_model_len}]})
        if (method, path) == ("POST", "/tokenize") and self.tokenize:
            ids = self.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
            return _json(handler, 200, {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})
        if (method, path) == ("POST", "/v1/completions"):
            return self._complete(handler, body)
        return _error(handler, 404, f"no route {method} {path}")

    def _complete(self, handler, body: dict):
        if body.get("model") != self.model:
            return _error(handler, 404, f"The model `{body.get('model')}` does not exist.")
        known = {"model", "prompt", "max_tokens", "temperature"}
        if not self.token_ids and set(body) - known:
            return _error(handler, 422, f"Unexpected fields in the request: {set(body) - known}")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if not self.token_ids:
                return _error(handler, 400, "prompt must be a string.")
            ids = prompt
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            return _error(handler, 400, "prompt must be a string or a list of token ids")
        if ids and max(ids) >= self.vocab_size:
            return _error(handler, 400, f"Token id {max(ids)} is out of vocabulary")
        max_tokens = int(body.get("max_tokens", 16))
        if max_tokens > 1:
            text = self.tokenizer.decode(ids)
            with self._lock:
                self.attempts[text] = attempt = self.attempts.get(text, 0) + 1
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                time.sleep(self.delay)
                status = self.fail(text, attempt) if self.fail else None
                if status:
                    return _error(handler, status, f"failing on purpose (attempt {attempt})")
                new = self._generate(ids, max_tokens, float(body.get("temperature", 1.0)))
                with self._lock:
                    self.completions.append(list(ids))
            finally:
                with self._lock:
                    self.in_flight -= 1
        else:
            new = self._generate(ids, max_tokens, 0.0)
        choice = {"index": 0, "text": self.tokenizer.decode(new, skip_special_tokens=True),
                  "finish_reason": "length" if len(new) >= max_tokens else "stop"}
        if body.get("return_token_ids"):
            choice["token_ids"] = new
        return _json(handler, 200, {"id": "cmpl-test", "object": "text_completion", "model": self.model,
                                    "choices": [choice], "usage": {"prompt_tokens": len(ids),
                                                                   "completion_tokens": len(new),
                                                                   "total_tokens": len(ids) + len(new)}})

    def _generate(self, ids: list[int], max_tokens: int, temperature: float) -> list[int]:
        device = next(self.target.parameters()).device
        kwargs = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with self._generate_lock, torch.no_grad():
            output = self.target.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens, **kwargs)
        return output[0, len(ids):].tolist()


def _send(handler, status: int, data: bytes, kind: str):
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _json(handler, status: int, body: dict):
    _send(handler, status, json.dumps(body).encode(), "application/json")


def _error(handler, status: int, message: str):
    _json(handler, status, {"error": {"message": message, "type": "BadRequestError", "code": status}})
