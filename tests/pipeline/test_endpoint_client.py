"""The OpenAI-compatible completions client (models/prompts/endpoint.py) against servers that take a
list of prompts and servers that take one prompt string per request (``transformers serve``: HTTP
400 on a list): every prompt gets its one answer, in order. ``-m servers``: a real ``transformers
serve`` process on localhost."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from models.prompts.endpoint import CompletionsClient, EndpointError, predict_labels, serve_folder


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
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def one_string_server():
    _OneString.seen = []
    server = HTTPServer(("127.0.0.1", 0), _OneString)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


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
