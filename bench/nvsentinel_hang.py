"""Health and /healthz while NVSentinel's platform connector hangs (issue 42: "a connector holding every call for 40 s
leaves health within 5 s and `/healthz` up").

Runs the real `gpu-node-agent run --simulate dgx-h100 --nvsentinel-socket SOCK` process (`tests/app/agentproc.py`,
dry-run remediation) with the stand-in connector of the tests (`tests/fakes/nvsentinel.py`) holding every call for
`--hold` seconds, and, for comparison, the same agent without a connector. Each trial appends an Xid 79 for the
next GPU to the agent's kernel log and times until /metrics shows that GPU unhealthy (and, for the first, the
node's verdict `drain`), polling every 20 ms. Then, until `--hold` seconds after the first call reached the
connector, GET /healthz every 200 ms (a fresh connection each, as the kubelet's probe) and time each answer.
Prints the latencies, the probes' statuses and the agent's `gpu_node_agent_nvsentinel_events_total{outcome}`.

    python bench/nvsentinel_hang.py [--hold 40] [--trials 4] [--modes hang none]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the rigs live in tests/

from agent.simulate.profiles import load_profile
from tests.app.agentproc import AgentProcess
from tests.fakes.kmsg import xid_record
from tests.fakes.nvsentinel import FakeConnector
from tests.fakes.polling import until

DRAIN = 'gpu_node_agent_node_verdict{verdict="drain"} 1.0'


def _healthz(port: int) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            status = int(response.status)
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError:
        status = 0
    return status, time.monotonic() - started


def _unhealthy(text: str, uuid: str) -> bool:
    return any(line.startswith("gpu_node_agent_device_healthy{") and f'"{uuid}"' in line and line.endswith(" 0.0")
               for line in text.splitlines())


def _outcomes(text: str) -> dict[str, str]:
    prefix = 'gpu_node_agent_nvsentinel_events_total{outcome="'
    return {line[len(prefix):].split('"')[0]: line.rsplit(" ", 1)[1] for line in text.splitlines()
            if line.startswith(prefix)}


async def one_mode(hang: bool, hold: float, trials: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="gnbn"))
    kmsg = directory / "kmsg"
    kmsg.write_text("")
    fake = FakeConnector(directory / "nvs.sock", hold=hold) if hang else None
    if fake is not None:
        await fake.start()
    gpus = sorted(load_profile("dgx-h100").gpu_uuids.items())
    agent = AgentProcess(directory, "--kmsg", str(kmsg), "--node-name", "dgx-nvs-1",
                         *(["--nvsentinel-socket", str(fake.socket_path)] if fake is not None else []))
    try:
        await until(lambda: agent.ready() or agent.process.poll() is not None, "the agent ready", timeout=120)
        if agent.process.poll() is not None:
            raise RuntimeError(agent.log_tail())
        latencies: list[float] = []
        first_call = None
        for trial in range(trials):
            bus_id, uuid = gpus[trial % len(gpus)]
            with kmsg.open("a") as handle:
                handle.write(xid_record(7001 + trial, bus_id, 79, "pid=4242, name=x, GPU has fallen off the bus."))
            written = time.monotonic()
            while True:
                text = await asyncio.to_thread(agent.metrics)
                if _unhealthy(text, uuid) and DRAIN in text:
                    break
                if time.monotonic() - written > 30:
                    raise RuntimeError(f"GPU {uuid} not unhealthy 30 s after its Xid")
                await asyncio.sleep(0.02)
            latencies.append(time.monotonic() - written)
            if fake is not None and first_call is None:
                await until(lambda: fake.calls >= 1, "the first call reaching the connector", timeout=30)
                first_call = time.monotonic()
        probes: list[tuple[int, float]] = []
        window_end = (first_call or time.monotonic()) + hold
        while time.monotonic() < window_end:
            probes.append(await asyncio.to_thread(_healthz, agent.port))
            await asyncio.sleep(0.2)
        text = await asyncio.to_thread(agent.metrics)
        return {"latencies": latencies, "probes": probes, "outcomes": _outcomes(text),
                "calls": fake.calls if fake is not None else 0, "alive": agent.process.poll() is None}
    finally:
        agent.stop()
        if fake is not None:
            await fake.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def main(args: argparse.Namespace) -> None:
    for mode in args.modes:
        load = os.getloadavg()
        result = await one_mode(mode == "hang", args.hold, args.trials)
        title = f"connector holding every call {args.hold:.0f} s" if mode == "hang" else "no connector"
        print(f"{title} (load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end)")
        ms = [x * 1000 for x in result["latencies"]]
        print(f"  Xid 79 -> GPU unhealthy and verdict drain in /metrics, {len(ms)} trials: median "
              f"{statistics.median(ms):.0f} ms, max {max(ms):.0f} ms (each: {', '.join(f'{x:.0f}' for x in ms)})")
        statuses = [status for status, _ in result["probes"]]
        taken = sorted(seconds * 1000 for _, seconds in result["probes"])
        if taken:
            p99 = taken[min(len(taken) - 1, round(0.99 * (len(taken) - 1)))]
            print(f"  /healthz, {len(taken)} probes over the window: {statuses.count(200)} answered 200; median "
                  f"{statistics.median(taken):.1f} ms, p99 {p99:.1f} ms, max {taken[-1]:.1f} ms")
        print(f"  connector calls received: {result['calls']}; events_total: {result['outcomes']}; "
              f"agent still running: {result['alive']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=40.0, help="seconds the connector holds every call")
    parser.add_argument("--trials", type=int, default=4, help="Xid 79 trials (one GPU each, up to 8)")
    parser.add_argument("--modes", nargs="+", choices=("hang", "none"), default=["hang", "none"])
    parsed = parser.parse_args()
    if not 1 <= parsed.trials <= 8 or parsed.hold <= 0:
        parser.error("--trials must be 1..8 and --hold > 0")
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(parsed))
