"""Bench: /healthz under a flood of idle connections to the metrics port (issue 14, item 5).

A child process serves the agent's real MetricsServer (default limits) on loopback; this process opens N idle
TCP connections that never send a request, then times GET /healthz (a fresh connection each, as the kubelet's
probe does) and reports the server's RSS before and after. Goal: every /healthz within 1 s under 3,000 idle
connections, RSS flat.

    python bench/http_idle.py [--idle 3000] [--probes 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import socket
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from prometheus_client import CollectorRegistry

from agent.http import MetricsServer, Readiness


def _serve(port_out: multiprocessing.connection.Connection) -> None:
    readiness = Readiness()
    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), readiness)
    server.start()
    port_out.send(server.port)
    while True:  # the heartbeat the event loop would give
        readiness.beat()
        time.sleep(0.5)


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _probe(port: int) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as response:
        response.read()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=3000)
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 256)), hard))
    here, there = multiprocessing.Pipe()
    child = multiprocessing.Process(target=_serve, args=(there,), daemon=True)
    child.start()
    port = here.recv()
    time.sleep(0.5)
    before = _rss_mb(child.pid)
    quiet = [_probe(port) for _ in range(5)]
    idle = []
    for _ in range(args.idle):
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        except OSError as exc:
            print(f"stopped opening connections at {len(idle)}: {exc}")
            break
    time.sleep(1.0)
    times = [_probe(port) for _ in range(args.probes)]
    after = _rss_mb(child.pid)
    held = sum(1 for s in idle if _still_open(s))
    print(f"idle connections opened: {len(idle)}; still held by the server: {held}")
    print(f"/healthz quiet:  median {statistics.median(quiet) * 1000:.1f} ms")
    print(f"/healthz loaded: median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms "
          f"over {len(times)} probes (goal: every one under 1000 ms)")
    print(f"server RSS: {before:.1f} MB before, {after:.1f} MB with the idle connections")
    for sock in idle:
        sock.close()
    child.terminate()


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
