"""A load test of ``bitsplit serve`` that ends by itself (loopback only): N concurrent clients send a
bounded number of requests, a mix of streaming and not, a share of them hanging up at a random
point, some with malformed bodies. Reports what came back and the server's footprint.

    python bench/server_load.py SPLIT_DIR [--clients 16] [--requests 64] [--max-tokens 24]
                                [--drop 0.25] [--malformed 0.1] [--queue 8] [--seed 0] [--settle 12] [--json]

Every answered greedy completion is compared with the same request made alone on the idle server
after the load, the same way (it must be equal: requests never see each other's state). Clients do
not wait after a 503 (they move on to their next request), so a small --queue sheds many. The
server runs as a ``bitsplit serve`` child process; its RSS and thread count come from /proc after a
first request and again after the load (once idle for --settle seconds and asked for /health:
anyio lets its idle worker threads go after 10 s, at its next call); at the end it gets SIGTERM
and its exit status is printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["def quicksort(arr):", "The capital of France is", "import numpy as np\n", "Once upon a time",
           "SELECT name FROM users WHERE", "for i in range(10):", "A haiku about the sea:", "class Stack:"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _thread_names(pid: int) -> dict:
    names: dict[str, int] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            n = (t / "comm").read_text().strip()
        except OSError:
            continue
        names[n] = names.get(n, 0) + 1
    return names


def _proc_stats(pid: int) -> dict:
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return {"rss_bytes": rss, "threads": threads, "thread_names": _thread_names(pid)}


class Load:
    def __init__(self, port: int, a):
        self.port, self.a = port, a
        self.lock = threading.Lock()
        self.results: list[dict] = []

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=60) as r:
            return json.loads(r.read())

    def fetch(self, prompt: str, stream: bool) -> str:
        """One greedy completion, nothing else running."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": self.a.max_tokens,
                                                            "temperature": 0, "stream": stream}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if not stream:
            text = json.loads(r.read())["choices"][0]["text"]
        else:
            parts = []
            for line in r:
                if line.startswith(b"data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
            text = "".join(parts)
        conn.close()
        return text

    def one(self, i: int, rng: random.Random) -> dict:
        a = self.a
        kind = "stream" if rng.random() < 0.5 else "plain"
        if rng.random() < a.malformed:
            kind = "malformed"
        drop = kind != "malformed" and rng.random() < a.drop
        prompt = rng.choice(PROMPTS)
        body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "stream": kind == "stream"}
        raw = json.dumps(body).encode() if kind != "malformed" else rng.choice(
            [b"{not json", b'{"prompt": 5, "max_tokens": -1}', b'{"max_tokens": 4}'])
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        rec = {"i": i, "kind": kind, "drop": drop, "prompt": prompt, "status": None, "text": None, "tokens": 0}
        try:
            conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
            if drop and kind == "plain":
                time.sleep(rng.uniform(0.05, 1.5))  # hang up before the answer
                conn.close()
                rec["status"] = "dropped"
                return rec
            r = conn.getresponse()
            rec["status"] = r.status
            if r.status != 200:
                r.read()
                return rec
            if kind == "plain":
                obj = json.loads(r.read())
                rec["text"] = obj["choices"][0]["text"]
                rec["tokens"] = obj["usage"]["completion_tokens"]
            else:
                stop_after = rng.randint(1, a.max_tokens) if drop else None
                parts, n = [], 0
                while True:
                    line = r.readline()
                    if not line or line.startswith(b"data: [DONE]"):
                        break
                    if line.startswith(b"data: {"):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            rec["status"] = "stream-error"
                            break
                        parts.append(obj["choices"][0]["text"])
                        n += 1
                        if stop_after is not None and n >= stop_after:
                            conn.close()
                            rec["status"] = "dropped"
                            return rec
                rec["text"], rec["tokens"] = "".join(parts), n
        except (OSError, http.client.HTTPException) as exc:
            rec["status"] = f"error: {exc.__class__.__name__}"
        finally:
            rec["seconds"] = time.perf_counter() - t0
            conn.close()
        return rec

    def client(self, idx: int, todo: list[int]) -> None:
        rng = random.Random(self.a.seed * 1000 + idx)
        while True:
            with self.lock:
                if not todo:
                    return
                i = todo.pop()
            rec = self.one(i, rng)
            with self.lock:
                self.results.append(rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--drop", type=float, default=0.25)
    ap.add_argument("--malformed", type=float, default=0.1)
    ap.add_argument("--queue", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=12.0, help="idle seconds before the end figures")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitsplit_llama.cli", "serve", a.split, "--port", str(port),
                             "--n-ctx", str(a.n_ctx), "--queue", str(a.queue)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load = Load(port, a)
    try:
        for _ in range(1200):
            try:
                if load.health()["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit("server_load: the server did not come up")
        # one request first, so that the start figures include a loaded, warmed-up model
        load.one(-1, random.Random(1))
        start = _proc_stats(proc.pid)
        todo = list(range(a.requests))
        t0 = time.perf_counter()
        ths = [threading.Thread(target=load.client, args=(k, todo)) for k in range(a.clients)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        while load.health()["status"] != "ok":
            time.sleep(0.05)
        res = load.results
        answered = [r for r in res if r["status"] == 200 and r["kind"] != "malformed"]
        # the same requests alone, on the idle server, the same way (streamed or not: llama-cpp-python's
        # stream holds back incomplete UTF-8, so a streamed text may differ from a plain one)
        alone_cache: dict[tuple[str, str], str] = {}
        mismatches = 0
        for r in answered:
            key = (r["prompt"], r["kind"])
            if key not in alone_cache:
                alone_cache[key] = load.fetch(r["prompt"], r["kind"] == "stream")
            if r["text"] != alone_cache[key]:
                mismatches += 1
                print(f"server_load: mismatch ({r['kind']}, {r['prompt']!r}): {r['text']!r} alone: {alone_cache[key]!r}",
                      file=sys.stderr)
        # the server's worker threads (anyio's pool, grown by waiting requests) are let go once idle
        # for 10 s, when the next call comes (here: /health)
        time.sleep(a.settle)
        load.health()
        end = _proc_stats(proc.pid)
        lat = sorted(r["seconds"] for r in answered)
        out = {
            "requests": len(res), "clients": a.clients,
            "answered_correctly": len(answered) - mismatches, "answered": len(answered),
            "mismatches_vs_alone": mismatches,
            "malformed": sum(r["kind"] == "malformed" for r in res),
            "malformed_4xx": sum(r["kind"] == "malformed" and isinstance(r["status"], int) and 400 <= r["status"] < 500
                                 for r in res),
            "busy_503": sum(r["status"] == 503 for r in res),
            "dropped": sum(r["status"] == "dropped" for r in res),
            "other": sorted({str(r["status"]) for r in res} - {"200", "503", "dropped", "400", "422"}),
            "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
            "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3) if lat else None,
            "tokens_per_s_served": round(sum(r["tokens"] for r in answered) / wall, 2),
            "wall_s": round(wall, 1), "server_start": start, "server_end": end,
        }
        if a.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:22} {v}")
    finally:
        proc.terminate()
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed"
        print(f"server exit status after SIGTERM: {rc}", file=sys.stderr)


if __name__ == "__main__":
    main()
