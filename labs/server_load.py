"""Load test of ``sharpi serve`` on loopback: C concurrent streaming clients x R requests each.

Starts ``sharpi serve`` (the demo model unless ``-m``) in a child process on a free port, waits for
/health, then runs the clients (asyncio + httpx, one connection each). Every request must end in a
complete stream (``data: [DONE]``) or a 429 (the bounded queue refusing); anything else — an error
status, a stream cut short, a request over ``--timeout`` — counts as lost or hung and fails the run.
A refused client waits the Retry-After the server sent and moves on to its next request.

Reports requests/s, the time to the first streamed token (p50/p95, answered requests), the
server's RSS before and after (VmRSS of the child: a flat line says nothing leaks per request).

    PYTHONPATH=. python3 labs/server_load.py [--clients 16] [--requests 20] [--max-tokens 32] [-m MODEL] [--max-queue 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

QUESTIONS = (
    "What is a decorator?",
    "Explain the for statement.",
    "What is None?",
    "How does the with statement work?",
    "What is a generator?",
    "Explain list comprehensions.",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(client, url, model, i, max_tokens, timeout):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, done, n = None, False, 0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
                if r.status_code == 429:
                    return "refused", float(r.headers.get("Retry-After", "1")), None
                if r.status_code != 200:
                    return f"status {r.status_code}", 0.0, None
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        c = json.loads(line[6:])
                        if c["choices"] and c["choices"][0].get("delta", {}).get("content"):
                            n += 1
                            if ttft is None:
                                ttft = time.perf_counter() - t0
    except TimeoutError:
        return "hung", 0.0, None
    except httpx.HTTPError as e:
        return f"lost ({type(e).__name__})", 0.0, None
    return ("answered" if done else "cut short"), 0.0, ttft


async def run_clients(url, model, clients, requests, max_tokens, timeout):
    outcomes, ttfts = [], []

    async def client_loop(c):
        async with httpx.AsyncClient(timeout=timeout) as client:
            for k in range(requests):
                what, retry, ttft = await one(client, url, model, c * requests + k, max_tokens, timeout)
                outcomes.append(what)
                if ttft is not None:
                    ttfts.append(ttft)
                if what == "refused":
                    await asyncio.sleep(retry)

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return outcomes, ttfts, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    a = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "engine.cli.main", "-q", "serve", "--port", str(port), "--max-queue", str(a.max_queue)]
    if a.model:
        cmd += ["-m", a.model]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                print("the server did not come up", file=sys.stderr)
                return 1
            time.sleep(0.2)
        model = httpx.get(f"{url}/models").json()["data"][0]["id"]
        asyncio.run(run_clients(url, model, 2, 2, a.max_tokens, a.timeout))  # warm up (numba, caches)
        rss0 = rss_mib(server.pid)
        outcomes, ttfts, wall = asyncio.run(run_clients(url, model, a.clients, a.requests, a.max_tokens, a.timeout))
        rss1 = rss_mib(server.pid)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.terminate()
        server.wait(30)
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    answered = counts.get("answered", 0)
    t = np.asarray(ttfts) * 1000
    print(f"{a.clients} clients x {a.requests} requests, max_tokens {a.max_tokens}, queue {a.max_queue}: {counts}")
    print(f"wall {wall:.1f} s, answered {answered / wall:.2f} requests/s, all {len(outcomes) / wall:.2f} requests/s")
    if len(t):
        print(f"time to first token: p50 {np.percentile(t, 50):.0f} ms, p95 {np.percentile(t, 95):.0f} ms (answered requests)")
    print(f"server RSS: {rss0:.0f} MiB after warm-up, {rss1:.0f} MiB after the run")
    for line in metrics.splitlines():
        if line.startswith(("sharpi_requests_rejected_total", "sharpi_completion_tokens_total", "sharpi_requests_total{")):
            print("  ", line)
    bad = len(outcomes) - answered - counts.get("refused", 0)
    if len(outcomes) != a.clients * a.requests or bad:
        print(f"FAIL: {bad} requests lost or hung", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
