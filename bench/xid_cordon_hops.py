"""Module hops from an Xid line in the kernel log to the Node PATCH that cordons (issue 38: "the flows from the
README's architecture picture (GetPreferredAllocation, Xid -> cordon) with no more hops than today").

Runs the whole agent in this process (`agent.app.run_agent` with the `run` command's own flags: `--simulate
dgx-h100 --kubeconfig K --node-name N --remediation --no-dry-run --kmsg FILE`) against the HTTP API double of the
tests, waits for its first verdict on the Node, then records every call from one `agent.*` module into another
(`sys.setprofile` on the loop's thread, `threading.setprofile` for worker threads): first for `--control` seconds
with nothing happening (what the agent does anyway), then from appending an Xid 79 line to the kmsg file until
`agent.kube.cluster`'s `patch_node` is called with `spec.unschedulable: true` and that PATCH reaches the HTTP
transport (`agent.kube.transport.handle_async_request`). Printed:

- the module chain (consecutive `agent.*` modules on the stack, outermost first) at the first call into
  `agent.health.kmsg_watch._dispatch` (the Xid parsed, in the kernel-log task), at the cordon's `patch_node`
  and at its request in the transport (in the remediation task): the hops of the two ends of the flow;
- the cross-module call edges (caller function -> callee function) seen in the Xid window but not in the control
  window, their module pairs, and the tasks (outermost `agent.*` frame below the supervisor) they ran in, each with
  the deepest module chain it reached in the Xid window.

    python bench/xid_cordon_hops.py [--control 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the rigs live in tests/

from agent import cli, config
from agent.app import run_agent
from agent.simulate.profiles import load_profile
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.kmsg import xid_record
from tests.fakes.ports import free_port

NODE = "gpu-node-1"
Edge = tuple[str, str, str, str]  # caller module, caller function, callee module, callee function


def _module(frame: FrameType | None) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _stack(frame: FrameType | None) -> list[tuple[str, str]]:
    """The `agent.*` frames of a stack, outermost first, as (module, function)."""
    frames = []
    while frame is not None:
        if _module(frame).startswith("agent."):
            frames.append((_module(frame), frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


def _chain(stack: list[tuple[str, str]]) -> list[str]:
    """The modules a stack passes through (consecutive repeats folded), below the supervisor."""
    modules: list[str] = []
    for module, _ in stack:
        if module != "agent.supervisor" and (not modules or modules[-1] != module):
            modules.append(module)
    return modules


def _task(stack: list[tuple[str, str]]) -> str:
    below = [entry for entry in stack if entry[0] != "agent.supervisor"]
    return f"{below[0][0]}.{below[0][1]}" if below else "(supervisor)"


class Recorder:
    """Cross-module agent calls, per window; stops itself at the cordon's patch_node."""

    def __init__(self) -> None:
        self.on = False
        self.window = "control"
        self.edges: dict[str, collections.Counter[Edge]] = {"control": collections.Counter(),
                                                             "xid": collections.Counter()}
        self.tasks: dict[Edge, set[str]] = collections.defaultdict(set)
        self.chains: dict[str, list[str]] = {}
        self.deepest: dict[str, list[str]] = {}
        self.cordoned = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = _module(frame)
        if not module.startswith("agent."):
            return
        name = frame.f_code.co_name
        caller = frame.f_back
        while caller is not None and not _module(caller).startswith("agent."):
            caller = caller.f_back  # through asyncio / library frames to the agent code that called
        if self.window == "xid" and module == "agent.health.kmsg_watch" and name == "_dispatch" \
                and "xid" not in self.chains:
            self.chains["xid"] = _chain(_stack(frame))
        if self.window == "xid" and module == "agent.kube.cluster" and name == "patch_node":
            patch = frame.f_locals.get("patch") or {}
            if (patch.get("spec") or {}).get("unschedulable") is True:
                self.chains["cordon"] = _chain(_stack(frame))
        if "cordon" in self.chains and module == "agent.kube.transport" and name == "handle_async_request" \
                and "request" not in self.chains:
            self.chains["request"] = _chain(_stack(frame))  # the cordon's PATCH leaving through the transport
            self.on = False
            self.cordoned.set()
        if caller is None or _module(caller) == module:
            return
        edge = (_module(caller), caller.f_code.co_name, module, name)
        with self.lock:
            self.edges[self.window][edge] += 1
            if self.window == "xid":
                stack = _stack(frame)
                task, chain = _task(stack), _chain(stack)
                self.tasks[edge].add(task)
                if len(chain) > len(self.deepest.get(task, [])):
                    self.deepest[task] = chain


def _config(directory: Path, api: ApiServerDouble, kmsg: Path) -> config.AgentConfig:
    """The `run` command's configuration from its own flags, as `gpu-node-agent run ...` builds it."""
    argv = ["run", "--simulate", "dgx-h100", "--device-plugin-dir", str(directory),
            "--metrics-address", f"127.0.0.1:{free_port()}", "--kubeconfig",
            str(write_kubeconfig(directory / "kubeconfig", api.url)), "--node-name", NODE, "--remediation",
            "--no-dry-run", "--kmsg", str(kmsg), "--preflight-taint", ""]
    return config.load(cli._parser().parse_args(argv), os.environ)


def _report(recorder: Recorder, took: float, control: float) -> None:
    flow = {edge: count for edge, count in recorder.edges["xid"].items() if edge not in recorder.edges["control"]}
    print(f"Xid 79 line -> cordon patch_node: {took * 1000:.0f} ms under the profiler")
    for end in ("xid", "cordon", "request"):
        chain = recorder.chains.get(end, [])
        print(f"module chain at the {end} end: {len(chain) - 1 if chain else '-'} hops: {' -> '.join(chain)}")
    print(f"cross-module call edges in the Xid window: {len(recorder.edges['xid'])}, of which not seen in the "
          f"{control:.0f} s control window: {len(flow)} (calls {sum(flow.values())})")
    for (a, af, b, bf), count in sorted(flow.items()):
        print(f"  {a}.{af} -> {b}.{bf}  x{count}  [{', '.join(sorted(recorder.tasks[(a, af, b, bf)]))}]")
    pairs = sorted({(a, b) for a, _, b, _ in flow})
    tasks = sorted({task for edge in flow for task in recorder.tasks[edge]})
    print(f"module pairs of those edges: {len(pairs)}; tasks they ran in: {len(tasks)}")
    for a, b in pairs:
        print(f"  {a} -> {b}")
    for task in tasks:
        chain = recorder.deepest.get(task, [])
        print(f"  task {task}: deepest chain {len(chain) - 1} hops: {' -> '.join(chain)}")



async def main(args: argparse.Namespace) -> None:
    directory = Path(tempfile.mkdtemp(prefix="gnbx"))
    api = ApiServerDouble(FakeClock(), NODE)
    await api.start()
    kmsg = directory / "kmsg"
    kmsg.write_text("")
    cfg = _config(directory, api, kmsg)
    bus_id = sorted(load_profile("dgx-h100").gpu_uuids)[0]
    recorder = Recorder()
    threading.setprofile(recorder)
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(cfg, stop))
    try:
        started = time.monotonic()
        while api.condition("GpuUnhealthy") is None:
            if agent.done() or time.monotonic() - started > 60:
                raise RuntimeError("no first verdict on the API double")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the first passes after the verdict settle
        sys.setprofile(recorder)
        recorder.on = True
        await asyncio.sleep(args.control)
        recorder.window = "xid"
        with kmsg.open("a") as handle:
            handle.write(xid_record(7001, bus_id, 79, "pid=4242, name=python3, GPU has fallen off the bus."))
        written = time.monotonic()
        while not recorder.cordoned.is_set():
            if time.monotonic() - written > 30:
                raise RuntimeError("no cordon within 30 s")
            await asyncio.sleep(0.01)
        took = time.monotonic() - written
    finally:
        recorder.on = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        stop.set()
        await asyncio.wait_for(agent, 30)
        await api.stop()
        shutil.rmtree(directory, ignore_errors=True)

    _report(recorder, took, args.control)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", type=float, default=3.0, help="seconds recorded before the Xid (background)")
    parsed = parser.parse_args()
    if parsed.control <= 0:
        parser.error("--control must be > 0")
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(parsed))
