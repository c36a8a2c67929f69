"""gRPC server implementations for the device-plugin servers: grpc.aio (what the agent runs) against a synchronous
`grpc.server` with a small thread pool, on the same unix socket and the same v1beta1 DevicePlugin service.

Each server runs in a process of its own (as the agent does, apart from the kubelet) with a servicer that answers
from fixed messages, so only the transport and the server's threading differ: GetDevicePluginOptions (an empty
call) and GetPreferredAllocation (64 available IDs in, 4 out). As with the kubelet, one ListAndWatch stream is
held open the whole time (64 devices sent once); on the synchronous server that stream occupies one of the pool's
threads. `sync-4-loop` hands each answer to an asyncio loop in another thread and waits for it, the hop a
synchronous server in the agent would need. The client is a synchronous channel in this process, one call at a
time, as the kubelet's device manager makes them. Per server: round-trip p50/p99, the server process's CPU time
per call (user + system, all threads, from /proc: 10 ms ticks, so idle CPU needs a long `--idle`), its idle CPU
with the stream open, and its thread count. Servers are run in turn, shuffled per round; figures are medians
over rounds.

    python bench/grpc_server.py [--rounds 3] [--calls 2000] [--idle 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

# name -> thread pool size (0: grpc.aio); "-loop": each answer is made on an asyncio loop in another thread of the
# server process and waited for (run_coroutine_threadsafe), as a synchronous server in the agent would have to:
# its policy, device health and PodResources client live on the agent's event loop
MODES = {"aio": 0, "sync-2": 2, "sync-4": 4, "sync-4-loop": 4}
IDS = [f"0000:{bus:02x}:00.{fn}" for bus in range(0x18, 0x20) for fn in range(1, 9)]
DEVICES = api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=i, health="Healthy") for i in IDS])
OPTIONS = api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
PREFERRED = api_pb2.PreferredAllocationResponse(
    container_responses=[api_pb2.ContainerPreferredAllocationResponse(deviceIDs=IDS[:4])])
REQUEST = api_pb2.PreferredAllocationRequest(container_requests=[
    api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=IDS, allocation_size=4)])


class AioServicer(api_pb2_grpc.DevicePluginServicer):
    """Fixed answers, asyncio methods (the agent's servicer is asyncio)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return OPTIONS

    async def ListAndWatch(self, request: Any, context: Any) -> Any:
        yield DEVICES
        await self.stop.wait()

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return PREFERRED


class SyncServicer(api_pb2_grpc.DevicePluginServicer):
    """Fixed answers, blocking methods on the pool's threads; with `loop`, each answer made on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.stop = threading.Event()
        self.loop = loop

    def _answer(self, message: Any) -> Any:
        if self.loop is None:
            return message

        async def made_there() -> Any:
            return message

        return asyncio.run_coroutine_threadsafe(made_there(), self.loop).result()

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self._answer(OPTIONS)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        yield DEVICES
        while not self.stop.wait(1.0) and context.is_active():
            pass

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return self._answer(PREFERRED)


def serve(mode: str, path: str) -> None:
    """The server process: serve until stdin closes."""
    workers = MODES[mode]
    if workers == 0:
        async def run() -> None:
            servicer = AioServicer()
            server = grpc.aio.server()
            api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
            server.add_insecure_port(f"unix://{path}")
            await server.start()
            await asyncio.to_thread(sys.stdin.read)
            servicer.stop.set()
            await server.stop(0.5)

        asyncio.run(run())
        return
    loop = None
    if mode.endswith("-loop"):
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
    sync = SyncServicer(loop)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    api_pb2_grpc.add_DevicePluginServicer_to_server(sync, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    sys.stdin.read()
    sync.stop.set()
    server.stop(0.5).wait()


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(mode: str, calls: int, idle: float) -> dict[str, float]:
    """Start a server, hold a ListAndWatch stream, time the calls; figures in µs (CPU %) per call."""
    directory = tempfile.mkdtemp(prefix="gnag")
    path = os.path.join(directory, "dp.sock")
    child = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--socket", path], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            if time.monotonic() > deadline or child.poll() is not None:
                raise RuntimeError(f"{mode}: server did not start")
            time.sleep(0.02)
        server = psutil.Process(child.pid)
        with grpc.insecure_channel(f"unix://{path}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)
            stream = stub.ListAndWatch(api_pb2.Empty())
            next(stream)  # the device list: the stream is open, as the kubelet holds it
            out: dict[str, float] = {}
            for name, call, request in (("empty", stub.GetDevicePluginOptions, api_pb2.Empty()),
                                        ("preferred", stub.GetPreferredAllocation, REQUEST)):
                for _ in range(200):  # warm-up
                    call(request, timeout=10)
                latencies = []
                cpu_before = _cpu(server)
                for _ in range(calls):
                    started = time.perf_counter()
                    call(request, timeout=10)
                    latencies.append((time.perf_counter() - started) * 1e6)
                out[f"{name} cpu"] = (_cpu(server) - cpu_before) / calls * 1e6
                out[f"{name} p50"] = statistics.median(latencies)
                out[f"{name} p99"] = _percentile(latencies, 0.99)
            cpu_before, started = _cpu(server), time.monotonic()
            time.sleep(idle)
            out["idle cpu %"] = (_cpu(server) - cpu_before) / (time.monotonic() - started) * 100
            out["threads"] = server.num_threads()
            stream.cancel()
        return out
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for leftover in Path(directory).iterdir():
            leftover.unlink()
        os.rmdir(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per method, server and round")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured per server")
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.socket)
        return 0
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; grpcio {grpc.__version__}")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in random.sample(list(MODES), len(MODES)):
            results[mode].append(measure(mode, args.calls, args.idle))
        print(f"round {round_ + 1} done; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    keys = list(results["aio"][0])
    print(f"{'server':11} " + " ".join(f"{k:>14}" for k in keys) + "   (µs per call; medians over rounds)")
    for mode, rows in results.items():
        print(f"{mode:11} " + " ".join(f"{statistics.median(r[k] for r in rows):14.{3 if '%' in k else 1}f}"
                                      for k in keys))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
