"""The OpenAI-compatible server, driven by the real openai client."""

from __future__ import annotations

import socket
import threading
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_split):
    import uvicorn

    from bitsplit_llama import BitsplitLlama
    from bitsplit_llama.api.server import create_app

    llm = BitsplitLlama(tiny_split, n_ctx=512, verbose=False, tree_nodes=8)
    port = _free_port()
    cfg = uvicorn.Config(create_app(llm, "tiny"), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(cfg)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    th.join(timeout=10)
    llm.close()


@pytest.fixture()
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server, api_key="none", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion_and_streaming(client):
    msgs = [{"role": "user", "content": "the cat"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text


def test_completion(client):
    r = client.completions.create(model="tiny", prompt="the dog", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].text, str)


def _post(url: str, body: bytes) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_requests_get_4xx_json(server):
    import json
    import urllib.request

    for body, code in ((b'{"messages": "not a list"}', 422), (b"{not json", 400),
                       (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', 422),
                       (b'{"messages": [{"role": "wizard", "content": "x"}]}', 422),
                       (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 422)):
        status, obj = _post(f"{server}/chat/completions", body)
        assert status == code, (body, status, obj)
        assert "message" in obj["error"]
    status, obj = _post(f"{server}/completions", json.dumps({"prompt": "x " * 600, "max_tokens": 4}).encode())
    assert status == 400 and "context" in obj["error"]["message"].lower()
    # the server is still fine
    with urllib.request.urlopen(f"{server}/models", timeout=30) as r:
        assert r.status == 200


def test_concurrent_requests_queue(client):
    prompts = ["the cat", "a dog is"]
    seq = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
           for p in prompts]
    out = [None, None]

    def call(i):
        out[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0).choices[0].text

    ts = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert out == seq


def test_dropped_stream_frees_the_model(server):
    """A client that reads three chunks of a stream and hangs up must not keep the model: the next
    request is answered (it used to wait forever: the stream's generator was never closed)."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(server)

    def post(body: dict) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", f"{u.path}/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn, conn.getresponse()

    conn, r = post({"model": "tiny", "prompt": "the cat", "max_tokens": 400, "temperature": 0, "stream": True})
    assert r.status == 200
    got = 0
    while got < 3:
        line = r.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            json.loads(line[6:])
            got += 1
    conn.close()  # hang up mid-stream
    conn, r = post({"model": "tiny", "prompt": "a dog is", "max_tokens": 8, "temperature": 0})
    assert r.status == 200
    assert isinstance(json.loads(r.read())["choices"][0]["text"], str)
    conn.close()
