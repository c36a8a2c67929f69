"""Module hops of one GetPreferredAllocation, from the gRPC servicer method to the answer.

Starts a `DevicePluginManager` on the simulated dgx-h100 node (GPUs and RDMA VFs, no kubelet needed), admits a
2-GPU container, then profiles the servicer's `GetPreferredAllocation` for its 2 VFs (NIC after GPU: the
admission context, the free estimate and the full search all run). Every call from one `agent.*` module into
another is recorded (`sys.setprofile`, this thread only) and printed with:

- the deepest chain of module hops below the servicer method;
- distinct cross-module call edges (caller function -> callee function), with and without property reads
  and dataclass constructors, and the module pairs they join;
- whether any call goes from `agent.placement` back into `agent.deviceplugin` (through its Protocols).

    python bench/preference_hops.py
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the node builders live in tests/fakes

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2
from agent.simulate.node import simulated_topology

GPU, RDMA = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
Edge = tuple[str, str, str, str]  # caller module, caller function, callee module, callee function


def _request(ids: list[str], size: int) -> api_pb2.PreferredAllocationRequest:
    return api_pb2.PreferredAllocationRequest(container_requests=[
        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=size)])


def _module(frame: FrameType | None) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class Recorder:
    """Cross-module calls inside agent/ below the servicer method."""

    def __init__(self) -> None:
        self.edges: collections.Counter[Edge] = collections.Counter()
        self.depth = 0
        self.deepest = ""
        self.properties: set[CodeType] = {item.fget.__code__ for item in gc.get_objects()
                                          if isinstance(item, property) and hasattr(item.fget, "__code__")}
        self.trivial: set[Edge] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not _module(frame).startswith("agent."):
            return
        hops, below, module = 0, frame, _module(frame)
        while below is not None and below.f_code.co_name != "GetPreferredAllocation":
            below = below.f_back
            name = _module(below)
            if name.startswith("agent.") and name != module:
                hops, module = hops + 1, name
        if below is None:
            return
        if hops > self.depth:
            self.depth, self.deepest = hops, f"{_module(frame)}.{frame.f_code.co_name}"
        caller = frame.f_back
        if caller is None or not _module(caller).startswith("agent.") or _module(caller) == _module(frame):
            return
        edge = (_module(caller), caller.f_code.co_name, _module(frame), frame.f_code.co_name)
        self.edges[edge] += 1
        if frame.f_code in self.properties or frame.f_code.co_name == "__init__":
            self.trivial.add(edge)


async def main() -> None:
    directory = tempfile.mkdtemp(prefix="gnh")
    # the simulated dgx-h100 (its VFs bound to a driver, so served; the fake node's are not ready since pools
    # skip driverless VFs)
    manager = DevicePluginManager(DevicePluginConfig(device_plugin_dir=directory, serve_gpus=True),
                                  simulated_topology("dgx-h100", Path(directory) / "sys"), poll_interval=5.0,
                                  register_timeout=0.1)
    try:
        await manager.start()
        gpus, vfs = manager.plugin(GPU), manager.plugin(RDMA)
        for _ in range(2):  # the first call builds the PCIe tree; the second container is the one paired
            reply = await gpus.GetPreferredAllocation(_request(list(gpus.pool.ids), 2), None)
            chosen = list(reply.container_responses[0].deviceIDs)
            await gpus.Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=chosen)]), None)
        recorder = Recorder()
        call = vfs.GetPreferredAllocation(_request(list(vfs.pool.ids), 2), None)
        sys.setprofile(recorder)
        try:
            reply = await call
        finally:
            sys.setprofile(None)
    finally:
        await manager.stop()
        shutil.rmtree(directory, ignore_errors=True)

    print(f"answer: {list(reply.container_responses[0].deviceIDs)}")
    for (a, af, b, bf), count in sorted(recorder.edges.items()):
        print(f"  {a}.{af} -> {b}.{bf}  x{count}")
    pairs = sorted({(a, b) for a, _, b, _ in recorder.edges})
    back = [(a, b) for a, b in pairs if a.startswith("agent.placement") and b.startswith("agent.deviceplugin")]
    print(f"deepest chain of module hops below the servicer: {recorder.depth} (to {recorder.deepest})")
    print(f"distinct cross-module call edges: {len(recorder.edges)} "
          f"({len(recorder.edges) - len(recorder.trivial)} without property reads and constructors); "
          f"cross-module calls in all: {sum(recorder.edges.values())}")
    print(f"module pairs: {len(pairs)}; placement -> deviceplugin at run time (Protocol calls): {len(back)}")
    for a, b in pairs:
        print(f"  {a} -> {b}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())
