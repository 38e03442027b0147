"""The OpenAI-compatible completions client (models/prompts/endpoint.py) against servers that take a
list of prompts and servers that take one prompt string per request (``transformers serve``: HTTP
400 on a list): every prompt gets its one answer, in order. ``-m servers``: a real ``transformers
serve`` process on localhost."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from models.prompts.endpoint import CompletionsClient, EndpointError, predict_labels, serve_folder, serve_gguf


class _OneString(BaseHTTPRequestHandler):
    """Answers a string prompt with its last word; a list with 400, as ``transformers serve`` does."""
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body["prompt"])
        if self.path == "/moved/v1/completions":  # a redirect elsewhere: the key would follow it
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/steal")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path != "/v1/completions":
            data, code = b'{"detail": "Not Found"}', 404
        elif not isinstance(body["prompt"], str):
            data, code = b'{"detail": "prompt must be a string."}', 400
        else:
            data, code = json.dumps({"choices": [{"index": 0, "text": " " + body["prompt"].split()[-1]}]}).encode(), 200
        _reply(self, code, data)

    def log_message(self, *args):
        pass


def _reply(handler, code: int, data: bytes) -> None:
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _serving(handler):
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


@pytest.fixture()
def one_string_server():
    _OneString.seen = []
    yield from _serving(_OneString)


def test_a_server_taking_one_prompt_string_answers_every_prompt_in_order(one_string_server):
    client = CompletionsClient(one_string_server, "any", batch_size=4)
    prompts = ["x positive", "y negative", "z positive", "w negative", "v positive"]
    choices = client.complete(prompts)
    assert [c["text"].strip() for c in choices] == ["positive", "negative", "positive", "negative", "positive"]
    assert predict_labels(choices, ["negative", "positive"]) == [1, 0, 1, 0, 1]
    # one list refused, then one string per request
    assert isinstance(_OneString.seen[0], list) and _OneString.seen[1:] == prompts and client.batch_size == 1


def test_another_client_error_is_one_endpoint_error(one_string_server):
    client = CompletionsClient(one_string_server.replace("/v1", "/nowhere"), "any", batch_size=1)
    with pytest.raises(EndpointError, match="HTTP 404"):
        client.complete(["x positive"])


def test_a_redirect_is_not_followed_with_the_key(one_string_server):
    client = CompletionsClient(one_string_server.replace("/v1", "/moved/v1"), "any", api_key="k", batch_size=1)
    with pytest.raises(EndpointError, match="HTTP 302"):
        client.complete(["x positive"])


def test_an_endpoint_url_holding_credentials_is_refused():
    from pydantic import ValidationError

    from tasks.schema import EndpointConfig

    with pytest.raises(ValidationError, match="api_key_env"):
        EndpointConfig(alias="r", base_url="https://user:secret@api.example.com/v1", model="m")
    assert EndpointConfig(alias="r", base_url="http://127.0.0.1:8000/v1", model="m").base_url.endswith("/v1")


@pytest.mark.servers
def test_a_real_transformers_serve_answers_through_the_client(tmp_path):
    """``transformers serve`` (Transformers' OpenAI-compatible server) on a local model folder: the
    client's list is refused, it falls back to strings, and every prompt gets a completion."""
    pytest.importorskip("openai", reason="transformers serve needs the openai package: pip install -e '.[serve]'")
    from models.backbones import load_backbone

    bb = load_backbone("tiny-gpt2", "cpu", seed=0)
    folder = tmp_path / "model"
    bb.model.save_pretrained(folder)
    bb.tokenizer.save_pretrained(folder)
    proc, url = serve_folder(str(folder), timeout_s=180)
    try:
        client = CompletionsClient(url, str(folder), batch_size=8, timeout_s=120)
        choices = client.complete(["Review: a fine film\nSentiment:", "Review: dull\nSentiment:", "Hello"])
        assert len(choices) == 3 and all(isinstance(c["text"], str) and c["text"] for c in choices)
        assert client.batch_size == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _LlamaLike(BaseHTTPRequestHandler):
    """As llama-cpp-python's server: a list of prompts answered with HTTP 500; one prompt answered with
    one generated token — with ``logit_bias``, the biased label of largest logit — and the UNBIASED
    top log-probabilities beside it (a one-letter " D" above every label)."""
    seen: list = []
    logits = {" D": -1.0, " human": -7.0, " location": -5.0, "\n": -0.5}
    ids = {" human": 1205, " location": 3695}

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if not isinstance(body["prompt"], str):
            data, code = b'{"error": {"message": "", "type": "internal_server_error"}}', 500
        else:
            bias = {int(k): v for k, v in (body.get("logit_bias") or {}).items()}
            biased = {t: lp + bias.get(self.ids.get(t, -1), 0) for t, lp in self.logits.items()}
            top = dict(sorted(self.logits.items(), key=lambda kv: -kv[1])[:body["logprobs"]])
            chosen = max(biased, key=biased.get)
            data = json.dumps({"choices": [{"index": 0, "text": chosen, "logprobs": {"top_logprobs": [top]}}]}).encode()
            code = 200
        _reply(self, code, data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def llama_like():
    _LlamaLike.seen = []
    yield from _serving(_LlamaLike)


def test_labels_biased_by_their_token_ids_are_read_from_the_one_generated_token(llama_like):
    labels = [" description", " human", " location"]
    client = CompletionsClient(llama_like, "any", batch_size=4, top_logprobs=3, label_token_ids=[5410, 1205, 3695])
    choices = client.complete(["Question: who ?\nAnswer type:", "Question: where ?\nAnswer type:"])
    body = _LlamaLike.seen[-1]
    assert body["logit_bias"] == {"5410": 100, "1205": 100, "3695": 100} and body["max_tokens"] == 1
    assert body["logprobs"] == 3 and client.batch_size == 1  # the list's HTTP 500: one prompt per request
    # the generated token is the biased label of largest log-probability: " location" (−5 > −7)
    assert predict_labels(choices, labels, text_first=True) == [2, 2]


def test_a_one_letter_token_stands_for_no_label_and_the_longest_match_counts():
    labels = [" description", " human"]
    choice = {"text": "\n", "top_logprobs": {" D": -1.0, " hum": -6.0, " human": -3.0, "\n": -0.5}}
    assert predict_labels([choice], labels) == [1]  # " D" is no label; " human" (−3), not " hum" (−6)
    only_letter = {"text": " D", "top_logprobs": {" D": -1.0}}
    assert predict_labels([only_letter], labels) == [None]
    whole = {"text": "", "top_logprobs": {" a": -1.0}}
    assert predict_labels([whole], [" a", " bb"]) == [0]  # a one-letter label is its own word


def test_label_token_ids_must_match_the_labels(tmp_path):
    from tasks.config import parse_config

    base = {"method": "dp_opt", "data": {"name": "toy", "labels": ["negative", "positive"], "test_shareable": True},
            "models": {"local": "tiny-gpt2", "endpoints": [{"alias": "r", "base_url": "http://127.0.0.1:1/v1",
                                                            "model": "m", "label_token_ids": [1]}]}}
    with pytest.raises(ValueError, match="label_token_ids has 1 ids for 2 labels"):
        parse_config(base)
    base["models"]["endpoints"][0]["label_token_ids"] = [4, 4]
    with pytest.raises(ValueError, match="repeats an id"):
        parse_config(base)


@pytest.mark.servers
def test_a_real_llama_cpp_server_answers_with_log_probabilities_and_the_label_bias():
    """llama.cpp's OpenAI-compatible server (llama-cpp-python[server], in this interpreter or in
    ``$PRIVPROMPT_LLAMA_PYTHON``) on SmolLM2's GGUF: a list refused (500) then one prompt per request,
    top log-probabilities returned, and with the labels' token ids biased the one token generated is a
    label — the same label the local SmolLM2 reads from its logits on most prompts."""
    import importlib.util
    import os

    python = os.environ.get("PRIVPROMPT_LLAMA_PYTHON")
    if python is None and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python[server] is not installed (or set PRIVPROMPT_LLAMA_PYTHON)")
    from models.backbones import load_backbone, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    bb = load_backbone("smollm2", "cpu")
    labels = ["negative", "positive"]
    ids = [bb.tokenizer(" " + w, add_special_tokens=False)["input_ids"][0] for w in labels]
    prompts = [f"Review: {t}\nSentiment:" for t in ("a wonderful , moving film", "dull and awful", "great fun",
                                                     "a waste of time", "warm and funny", "boring")]
    import torch

    with torch.no_grad():
        local = [int(bb.model(**bb.tokenizer(p, return_tensors="pt")).logits[0, -1, ids].argmax()) for p in prompts]
    proc, url = serve_gguf(gguf, alias="smollm2", python=python, timeout_s=240)
    try:
        plain = CompletionsClient(url, "smollm2", batch_size=4, timeout_s=120)
        choices = plain.complete(prompts[:2])
        assert plain.batch_size == 1 and all(c["top_logprobs"] for c in choices)
        biased = CompletionsClient(url, "smollm2", batch_size=1, timeout_s=120, label_token_ids=ids)
        remote = predict_labels(biased.complete(prompts), [" " + w for w in labels], text_first=True)
        assert None not in remote
        assert sum(a == b for a, b in zip(remote, local)) >= len(prompts) - 1  # Q4_1 kernels vs fp32: near ties may flip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
