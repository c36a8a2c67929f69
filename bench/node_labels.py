"""Node labels at steady state and after an Xid 79 (issue 39: "60 s of steady state: 0 writes"; "an Xid 79 lowers
`gpunodeagent.io/gpu.healthy` within 5 s").

For each publishing mode (`nodefeature`: the API double serves NFD's resource; `node`: it does not, so the labels
are patched on the Node), runs the real `gpu-node-agent run --simulate dgx-h100` process against the HTTP API
double of the label tests (`tests/labels/rig.py`: labels every second, dry-run remediation), waits for the first
publish, then counts every request the double receives for `--seconds` (by method and path; watches counted as
the requests that open them) and the write requests among them (PATCH/PUT/POST/DELETE). Then, in the same
process, `--trials` times: appends an Xid 79 line for the next healthy GPU to the agent's kernel log and times
until the published `gpu.healthy` drops by one (polling the double every 10 ms), and counts the label writes it
took.

    python bench/node_labels.py [--seconds 60] [--trials 5] [--modes nodefeature node]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the rigs live in tests/

from agent.simulate.profiles import load_profile
from tests.fakes.apiserver import ApiServerDouble
from tests.labels.rig import NAMESPACE, feature_labels, published, start, xid_line

WRITES = ("PATCH", "PUT", "POST", "DELETE")
HEALTHY = "gpunodeagent.io/gpu.healthy"


def _labels(mode: str, api: ApiServerDouble) -> dict[str, str]:
    return feature_labels(api) if mode == "nodefeature" else dict(api.labels)


def _label_writes(mode: str, api: ApiServerDouble, since: int) -> int:
    """Label writes among the double's requests from index `since` on (its request times follow a fake clock)."""
    later = api.requests[since:]
    if mode == "nodefeature":
        return len([r for r in later if r.method in WRITES and "/nodefeatures" in r.path])
    return len([r for r in later if r.method == "PATCH" and r.path.startswith("/api/v1/nodes/")
                and "labels" in ((r.body or {}).get("metadata") or {})])


def _shape(path: str) -> str:
    """A request path with the namespace kept and object names as they are: short enough to print."""
    return path.replace(f"/namespaces/{NAMESPACE}/", "/namespaces/NS/")


async def one_mode(mode: str, seconds: float, trials: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="gnbl"))
    agent, api, kmsg = await start(directory, nfd=mode == "nodefeature")
    try:
        await published(api, agent, lambda a: _labels(mode, a).get(HEALTHY), timeout=120)
        first = len(api.requests)
        await asyncio.sleep(seconds)
        window = api.requests[first:]
        by_kind = collections.Counter(f"{r.method} {_shape(r.path)}{' (watch)' if r.watch else ''}"
                                      for r in window)
        writes = [r for r in window if r.method in WRITES]
        latencies, per_change, all_writes = [], [], []
        gpus = sorted(load_profile("dgx-h100").gpu_uuids)
        for trial in range(trials):
            before = int(_labels(mode, api)[HEALTHY])
            mark = len(api.requests)
            with kmsg.open("a") as handle:
                handle.write(xid_line(gpus[trial % len(gpus)]).replace("7001", str(7001 + trial)))
            written = time.monotonic()
            while _labels(mode, api).get(HEALTHY) != str(before - 1):
                if time.monotonic() - written > 30:
                    raise RuntimeError(f"{mode}: gpu.healthy still {_labels(mode, api).get(HEALTHY)} after 30 s")
                await asyncio.sleep(0.01)
            latencies.append(time.monotonic() - written)
            await asyncio.sleep(2.5)  # any second write for the same change would land within two passes
            per_change.append(_label_writes(mode, api, mark))
            all_writes.append(len([r for r in api.requests[mark:] if r.method in WRITES]))
        if agent.process.poll() is not None:
            raise RuntimeError(agent.log_tail())
        return {"window": len(window), "writes": writes, "by_kind": by_kind, "latencies": latencies,
                "per_change": per_change, "all_writes": all_writes}
    finally:
        agent.stop()
        await api.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def main(args: argparse.Namespace) -> None:
    for mode in args.modes:
        load = os.getloadavg()
        result = await one_mode(mode, args.seconds, args.trials)
        print(f"mode {mode} (load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end)")
        print(f"  {args.seconds:.0f} s after the first publish: {result['window']} requests to the API double, "
              f"{len(result['writes'])} writes (PATCH/PUT/POST/DELETE)")
        for kind, count in sorted(result["by_kind"].items()):
            print(f"    {count:4d}  {kind}")
        for request in result["writes"]:
            print(f"    write: {request.method} {request.path}")
        if result["latencies"]:
            ms = [x * 1000 for x in result["latencies"]]
            print(f"  Xid 79 -> {HEALTHY} lowered by one, {len(ms)} trials: median {statistics.median(ms):.0f} ms, "
                  f"max {max(ms):.0f} ms (each: {', '.join(f'{x:.0f}' for x in ms)}); label writes per change: "
                  f"{result['per_change']} (all writes, condition and events included: {result['all_writes']})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="steady-state window after the first publish")
    parser.add_argument("--trials", type=int, default=5, help="Xid 79 trials (one GPU each, up to 8)")
    parser.add_argument("--modes", nargs="+", choices=("nodefeature", "node"), default=["nodefeature", "node"])
    parsed = parser.parse_args()
    if not 0 <= parsed.trials <= 8 or parsed.seconds < 0:
        parser.error("--trials must be 0..8 and --seconds >= 0")
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(parsed))
