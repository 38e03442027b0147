"""An OpenAI-compatible completions endpoint as a cross-model evaluation target (stdlib only).

Each request carries test inputs wrapped in the forward template with the published prompt. The
label is read from the returned top log-probabilities of the first token when the endpoint gives
them, else from the generated text. The caller decides what may be sent (never private rows)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class EndpointError(RuntimeError):
    """The endpoint could not be reached or answered with something unusable."""


@dataclass
class CompletionsClient:
    base_url: str                 # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0
    batch_size: int = 16

    def complete(self, prompts: list[str]) -> list[dict]:
        """One choice per prompt: {"text", "top_logprobs": {token: logprob} or None}. A server that
        takes one prompt string per request (``transformers serve``, some llama.cpp builds) answers a
        list with HTTP 400: the client then sends one prompt per request from there on."""
        out: list[dict] = []
        i = 0
        while i < len(prompts):
            chunk = prompts[i:i + self.batch_size]
            try:
                data = self._post(chunk[0] if len(chunk) == 1 else chunk)
            except _ListRefused:
                self.batch_size = 1
                continue
            choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
            if len(choices) != len(chunk):
                raise EndpointError(f"completions endpoint {self.base_url} returned {len(choices)} choices "
                                    f"for {len(chunk)} prompts")
            for c in choices:
                lp = (c.get("logprobs") or {}).get("top_logprobs") or None
                out.append({"text": c.get("text", ""), "top_logprobs": lp[0] if lp else None})
            i += len(chunk)
        return out

    def _post(self, prompt: str | list[str]) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                           "logprobs": 5}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url.rstrip("/") + "/completions", data=body, headers=headers)
        try:
            with _NO_REDIRECTS.open(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            if err.code in (400, 422) and isinstance(prompt, list):
                raise _ListRefused from None
            raise EndpointError(f"completions endpoint {self.base_url}: HTTP {err.code}: {err.reason}") from None
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as err:
            raise EndpointError(f"completions endpoint {self.base_url}: {type(err).__name__}: {err}") from None


class _Refuse(urllib.request.HTTPRedirectHandler):
    """No redirect is followed: urllib would re-send the Authorization header to wherever it points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_NO_REDIRECTS = urllib.request.build_opener(_Refuse)


class _ListRefused(Exception):
    """The server answered a list of prompts with a client error: it takes one string per request."""


def predict_labels(choices: list[dict], label_words: list[str]) -> list[int | None]:
    """The label index of every choice: the label word whose token has the largest returned
    log-probability, else the first label word the generated text starts with (None if neither)."""
    words = [w.strip().lower() for w in label_words]
    out: list[int | None] = []
    for c in choices:
        pick = None
        if c["top_logprobs"]:
            scores = {}
            for token, logprob in c["top_logprobs"].items():
                t = token.strip().lower()
                for i, w in enumerate(words):
                    if t and w.startswith(t) and logprob > scores.get(i, float("-inf")):
                        scores[i] = logprob
            if scores:
                pick = max(scores, key=scores.get)
        if pick is None:
            text = c["text"].strip().lower()
            pick = next((i for i, w in enumerate(words) if text.startswith(w)), None)
        out.append(pick)
    return out


def serve_folder(folder: str, timeout_s: float = 300.0):
    """Start ``transformers serve`` (Transformers' OpenAI-compatible server; needs the ``serve`` extra)
    on a local model folder, on a free localhost port, offline. Returns (process, base_url) once its
    /health answers; the caller terminates the process."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder),
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None:
                raise EndpointError("transformers serve exited (pip install -e '.[serve]')") from None
            time.sleep(0.5)
    proc.terminate()
    raise EndpointError(f"transformers serve on {folder} did not answer within {timeout_s:.0f} s")
