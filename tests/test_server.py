"""The OpenAI-compatible server, driven by the real openai client."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(app):
    import uvicorn

    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    return srv, th, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def llm(tiny_split):
    from bitsplit_llama import BitsplitLlama

    m = BitsplitLlama(tiny_split, n_ctx=512, verbose=False, tree_nodes=8)
    yield m
    m.close()


@pytest.fixture(scope="module")
def server(llm):
    from bitsplit_llama.api.server import create_app

    srv, th, url = _start(create_app(llm, "tiny"))
    yield url
    srv.should_exit = True
    th.join(timeout=10)


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
    # both numbers: the prompt's tokens and the context (--n-ctx 512, not the KV size with its reserve)
    msg = obj["error"]["message"]
    assert status == 400 and "context holds 512" in msg and "prompt has" in msg, msg
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


def _open(url: str, body: dict, path: str = "/completions"):
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", f"{u.path}{path}", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _health(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health", timeout=30) as r:
        return json.loads(r.read())


def _wait_idle(url: str) -> None:
    for _ in range(600):
        if _health(url) == {"status": "ok", "queue": 0}:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server stayed busy: {_health(url)}")


def _read_chunks(r, n: int) -> None:
    import json

    got = 0
    while got < n:
        line = r.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            json.loads(line[6:])
            got += 1


def test_oversized_body_is_413(server):
    """A body declared over the limit is refused from its Content-Length, before it is read."""
    import http.client
    from urllib.parse import urlparse

    from bitsplit_llama.api.server import MAX_BODY_BYTES

    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.putrequest("POST", f"{u.path}/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and str(MAX_BODY_BYTES) in r.read().decode()
    conn.close()


def test_oversized_chunked_body_is_413(server, monkeypatch):
    """A body sent without a Content-Length (chunked) is refused once it passes the limit; one under
    the limit is served as with a declared size."""
    import http.client
    from urllib.parse import urlparse

    from bitsplit_llama.api import server as srv

    monkeypatch.setattr(srv, "MAX_BODY_BYTES", 4096)
    u = urlparse(server)

    def post_chunked(pieces: list[bytes]) -> tuple[int, str]:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", f"{u.path}/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        try:
            for p in pieces:
                conn.send(b"%x\r\n%s\r\n" % (len(p), p))
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # refused before the whole body was sent
            pass
        r = conn.getresponse()
        out = r.status, r.read().decode()
        conn.close()
        return out

    body = json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": 2, "temperature": 0,
                       "stop": ["x" * 3000]}).encode()
    status, text = post_chunked([body[:100], body[100:]])
    assert status == 200, text
    status, text = post_chunked([body, body])
    assert status == 413 and "without a Content-Length" in text and "4096" in text, text


def test_loading_is_503(tiny_split):
    """Before the model is there, /health says loading (503, as llama-server) and requests get 503."""
    import json
    import urllib.error
    import urllib.request

    from bitsplit_llama.api.server import create_app

    app = create_app(None, "tiny")
    srv, th, url = _start(app)
    try:
        with pytest.raises(urllib.error.HTTPError) as ei:
            _health(url)
        assert ei.value.code == 503 and json.loads(ei.value.read()) == {"status": "loading", "queue": 0}
        conn, r = _open(url, {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status == 503 and r.getheader("Retry-After") and "loading" in json.loads(r.read())["error"]["message"]
        conn.close()
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def test_health(server):
    assert _health(server) == {"status": "ok", "queue": 0}


def test_dropped_stream_frees_the_model(server, llm):
    """A client that reads three chunks of a stream and hangs up must not keep the model: its
    generation stops and the next request is answered (it used to wait forever: the stream's
    generator was never closed)."""
    import json

    conn, r = _open(server, {"model": "tiny", "prompt": "the cat", "max_tokens": 400, "temperature": 0,
                             "stream": True, "stop": []})
    assert r.status == 200
    _read_chunks(r, 3)
    conn.close()  # hang up mid-stream
    _wait_idle(server)
    conn, r = _open(server, {"model": "tiny", "prompt": "a dog is", "max_tokens": 8, "temperature": 0})
    assert r.status == 200
    assert isinstance(json.loads(r.read())["choices"][0]["text"], str)
    conn.close()


def test_dropped_plain_request_stops_its_generation(server, llm):
    """A non-streaming request whose client hangs up is stopped at the next cycle, not run to the
    end (the whole greedy generation, about a second here, is measured first)."""
    _wait_idle(server)  # the model is free: use it directly
    llm.create_completion("the cat", max_tokens=480, temperature=0, stop=[])
    n_full = llm.last_stats.n_emitted
    assert n_full > 100
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", f"{u.path}/completions", json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": 480,
                                                               "temperature": 0, "stop": []}),
                 {"Content-Type": "application/json"})
    time.sleep(0.1)  # it starts at once (the model is idle), and runs about a second
    conn.close()
    _wait_idle(server)
    assert llm.last_stats.n_emitted < n_full


def test_full_queue_is_503_with_retry_after(llm, tiny_split):
    """With the model busy and no room to wait (--queue 0), a request is refused at once with 503
    and Retry-After; the stream holding the model is unaffected."""
    import json

    from bitsplit_llama.api.server import create_app

    srv, th, url = _start(create_app(llm, "tiny", queue=0))
    try:
        conn, r = _open(url, {"model": "tiny", "prompt": "the cat", "max_tokens": 400, "temperature": 0,
                              "stream": True, "stop": []})
        _read_chunks(r, 2)
        assert _health(url)["status"] == "busy"
        c2, r2 = _open(url, {"model": "tiny", "prompt": "a dog", "max_tokens": 4})
        assert r2.status == 503 and r2.getheader("Retry-After")
        assert "busy" in json.loads(r2.read())["error"]["message"]
        c2.close()
        _read_chunks(r, 2)  # the stream goes on
        conn.close()
        _wait_idle(url)
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def test_sigterm_during_a_stream_exits_cleanly(tiny_split):
    """`bitsplit serve`, SIGTERM while a stream runs: the generation stops, the process exits with
    status 0 (uvicorn used to wait for the stream for good)."""
    import signal
    import subprocess
    import sys

    port = _free_port()
    # a fixed tree keeps --tree-nodes auto's machine measurement (the first request's, once per native
    # build) out of this test, which is about SIGTERM, not about the first chunks' latency
    proc = subprocess.Popen([sys.executable, "-m", "bitsplit_llama.cli", "serve", str(tiny_split), "--port", str(port),
                             "--n-ctx", "512", "--tree-nodes", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        for _ in range(600):
            try:
                if _health(url)["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.1)
        conn, r = _open(url, {"model": "tiny", "prompt": "the cat", "max_tokens": 400, "temperature": 0,
                              "stream": True, "stop": []})
        _read_chunks(r, 2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
