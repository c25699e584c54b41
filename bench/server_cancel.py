"""How fast `bitsplit serve` lets go: a stream dropped after 3 chunks (seconds until /health says
the model is free, then the time of an 8-token request), a non-streaming request dropped 1 s in
(seconds until free), and SIGTERM during a stream (seconds to exit, and the exit status).

    python bench/server_cancel.py SPLIT_DIR [--n-ctx 1024]

Prints one JSON line. Loopback only; the server is a child process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

PROMPT = "def quicksort(arr):"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--n-ctx", type=int, default=1024)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "bitsplit_llama.cli", "serve", a.split, "--port", str(port),
                             "--n-ctx", str(a.n_ctx)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def health() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            return json.loads(r.read())

    def post(body: dict):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn

    def read_chunks(r, n: int) -> None:
        got = 0
        while got < n:
            line = r.readline()
            if not line:
                raise SystemExit("server_cancel: the stream ended early")
            got += line.startswith(b"data: {")

    def until(status: str) -> float:
        t0 = time.perf_counter()
        while health()["status"] != status:
            time.sleep(0.02)
        return time.perf_counter() - t0

    try:
        for _ in range(1200):  # the model loads while the server answers "loading" (503)
            try:
                if health()["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.1)
        out = {}
        # 1. a stream dropped after 3 chunks, then a short request
        conn = post({"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True})
        read_chunks(conn.getresponse(), 3)
        conn.close()
        out["dropped_stream_model_free_s"] = round(until("ok"), 2)
        t0 = time.perf_counter()
        conn = post({"prompt": "a", "max_tokens": 8, "temperature": 0})
        conn.getresponse().read()
        conn.close()
        out["next_request_8_tokens_s"] = round(time.perf_counter() - t0, 2)
        # 2. a non-streaming request dropped 1 s in
        conn = post({"prompt": PROMPT, "max_tokens": 200, "temperature": 0})
        until("busy")
        time.sleep(1.0)
        conn.close()
        out["dropped_plain_model_free_s"] = round(until("ok"), 2)
        # 3. SIGTERM during a stream
        conn = post({"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True})
        read_chunks(conn.getresponse(), 3)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out["exit_status"] = proc.wait(timeout=120)
        out["sigterm_exit_s"] = round(time.perf_counter() - t0, 2)
        conn.close()
        print(json.dumps(out))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
