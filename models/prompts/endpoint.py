"""An OpenAI-compatible completions endpoint as a cross-model evaluation target (stdlib only).

Each request carries test inputs wrapped in the forward template with the published prompt. The
label is read from the returned top log-probabilities of the first token when the endpoint gives
them, else from the generated text. With the labels' first token ids under the endpoint's tokenizer
(``logit_bias``), every label token gets +100: at temperature 0 the one generated token is the label
whose token has the largest log-probability — what the local target reads — and it is read from the
text (llama.cpp's server reports unbiased top log-probabilities beside it). The caller decides what
may be sent (never private rows)."""

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
    top_logprobs: int = 5         # OpenAI's completions take at most 5; llama.cpp's server more
    label_token_ids: list[int] | None = None  # each label's first token id under the endpoint's tokenizer

    @property
    def biased(self) -> bool:
        return bool(self.label_token_ids)

    def complete(self, prompts: list[str]) -> list[dict]:
        """One choice per prompt: {"text", "top_logprobs": {token: logprob} or None}. A server that
        takes one prompt string per request answers a list with an HTTP error (400 from ``transformers
        serve``, 500 from llama-cpp-python's server): the client then sends one prompt per request from
        there on (an error on one prompt is raised)."""
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
        request = {"model": self.model, "prompt": prompt, "max_tokens": 1 if self.biased else 3, "temperature": 0,
                   "logprobs": self.top_logprobs}
        if self.biased:
            request["logit_bias"] = {str(i): 100 for i in self.label_token_ids}
        body = json.dumps(request).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url.rstrip("/") + "/completions", data=body, headers=headers)
        try:
            with _NO_REDIRECTS.open(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            if err.code in (400, 422, 500) and isinstance(prompt, list):
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
    """The server answered a list of prompts with an HTTP error (400, 422 or 500): it takes one string per request."""


def predict_labels(choices: list[dict], label_words: list[str], text_first: bool = False) -> list[int | None]:
    """The label index of every choice: the label word whose token has the largest returned
    log-probability, else the first label word the generated text starts with (None if neither);
    ``text_first`` (requests biased to the labels' tokens): the text first. A returned token stands
    for a label when it is the start of the label word — the longest such token per label, and of two
    characters at least unless it is the whole word (a one-letter token such as " D" is no label)."""
    words = [w.strip().lower() for w in label_words]
    out: list[int | None] = []
    for c in choices:
        pick = _from_text(c["text"], words) if text_first else None
        if pick is None and c["top_logprobs"]:
            best: dict[int, tuple[int, float]] = {}  # label → (its longest matching token's length, logprob)
            for token, logprob in c["top_logprobs"].items():
                t = token.strip().lower()
                for i, w in enumerate(words):
                    if t and w.startswith(t) and (len(t) >= 2 or t == w) and len(t) > best.get(i, (0, 0.0))[0]:
                        best[i] = (len(t), logprob)
            if best:
                pick = max(best, key=lambda i: best[i][1])
        if pick is None and not text_first:
            pick = _from_text(c["text"], words)
        out.append(pick)
    return out


def _from_text(text: str, words: list[str]) -> int | None:
    text = text.strip().lower()
    return next((i for i, w in enumerate(words) if text.startswith(w)), None)


def serve_gguf(gguf: str, alias: str = "model", python: str | None = None, timeout_s: float = 300.0,
               threads: int = 1):
    """Start llama.cpp's OpenAI-compatible server (``python -m llama_cpp.server``, from the
    ``llama-cpp-python[server]`` package in the interpreter ``python``) on a GGUF file, on a free
    localhost port: it returns log-probabilities and takes ``logit_bias``. Returns (process, base_url)
    once ``/v1/models`` answers; the caller terminates the process."""
    import sys

    return _start([python or sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", alias,
                   "--n_threads", str(threads), "--host", "127.0.0.1", "--port", "{port}"],
                  "/v1/models", "llama.cpp's server (pip install 'llama-cpp-python[server]')", timeout_s)


def serve_folder(folder: str, timeout_s: float = 300.0):
    """Start ``transformers serve`` (Transformers' OpenAI-compatible server; needs the ``serve`` extra)
    on a local model folder, on a free localhost port, offline. Returns (process, base_url) once its
    /health answers; the caller terminates the process."""
    import sys

    return _start([sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder), "--port", "{port}"],
                  "/health", "transformers serve (pip install -e '.[serve]')", timeout_s)


def _start(command: list[str], probe: str, what: str, timeout_s: float):
    """A local server process on a free port (``{port}`` in ``command``), offline; (process, base_url)
    once ``probe`` answers."""
    import os
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([c.replace("{port}", str(port)) for c in command], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{probe}", timeout=1)
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None:
                raise EndpointError(f"{what} exited") from None
            time.sleep(0.5)
    proc.terminate()
    raise EndpointError(f"{what} did not answer within {timeout_s:.0f} s")
