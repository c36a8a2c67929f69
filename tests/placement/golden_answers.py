"""Golden preferred-allocation answers: record them on one commit, replay them on another, compare.

A seeded random run of containers on a simulated node (profiles `dgx-h100`, `pcie-pairs`, `dgx-h100-mig`), driven
as the kubelet drives the device plugin: the agent's `DevicePluginManager` registers with the stand-in kubelet
(`agent.simulate.kubelet.LocalKubelet`) and every call goes over the plugins' unix sockets (gRPC
`GetPreferredAllocation`, then `Allocate`). Containers ask for GPUs (or MIG slices), RDMA VFs or both, in either
order (NIC after GPU, NIC first), of sizes 1-8; some offers carry `must_include` devices, some are a subset of the
free devices (the topology manager's pick), some allocations ignore the preference (as the kubelet may), and
containers end at random, so the offers run on partly held nodes. The admission context's clock is a fake one
that advances 0.1 s per container (and now and then past the context's 5 s time-out), so a run does not depend on
the machine's speed.

`record` writes each request, the answer and what was allocated; `replay` sends the recorded requests to the code
it runs with, allocates what was allocated then (so one differing answer does not change the later offers), and
lists the answers that differ. Only public interfaces present at both ends are used (the manager's constructor,
the stand-in kubelet, gRPC), so the recording runs on an older commit as is:

    git -C /work/main worktree add --detach /tmp/base 1b51839
    PYTHONPATH=/tmp/base python tests/placement/golden_answers.py tests/placement/fixtures/answers-1b51839.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology

log = logging.getLogger(__name__)

GPU, MIG, NIC = "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "gpunodeagent.io/sriov_rdma"
# profile -> (MIG strategy, GPU-kind resources served)
PROFILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dgx-h100": ("none", (GPU,)),
    "pcie-pairs": ("none", (GPU,)),
    "dgx-h100-mig": ("mixed", (GPU, MIG)),
}
STEPS = 300  # containers per profile
SEED = 43


class StepClock:
    """The admission context's clock: monotonic time advanced by the run, wall time and waits real."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
        return event.is_set()


def mask(indices: set[int]) -> str:
    return format(sum(1 << i for i in indices), "x")


def unmask(text: str) -> set[int]:
    value = int(text, 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


@dataclass
class Node:
    """The stand-in kubelet and the agent's manager on one simulated profile, in a scratch directory."""

    profile: str
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gngold")))
    clock: StepClock = field(default_factory=StepClock)
    kubelet: LocalKubelet | None = None
    manager: DevicePluginManager | None = None

    async def __aenter__(self) -> Node:
        strategy, resources = PROFILES[self.profile]
        topology = simulated_topology(self.profile, self.directory / "sys")
        self.kubelet = kubelet = LocalKubelet(self.directory / "dp", rng=random.Random(0))  # noqa: S311
        await kubelet.start()
        config = DevicePluginConfig(device_plugin_dir=str(self.directory / "dp"), serve_gpus=True,
                                    mig_strategy=strategy)
        self.manager = DevicePluginManager(config, topology, plugin_registry_dir=str(self.directory / "reg"),
                                           cdi_spec_dir=str(self.directory / "cdi"), clock=self.clock,
                                           poll_interval=0.05, register_timeout=2.0)
        await self.manager.start()
        wanted = (*resources, NIC)
        await kubelet.wait_for(lambda: all(r in kubelet.plugins and kubelet.plugins[r].lists > 0
                                           and kubelet.plugins[r].connected for r in wanted))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.manager is not None:
            await self.manager.stop()
        if self.kubelet is not None:
            await self.kubelet.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def devices(self, resource: str) -> list[str]:
        assert self.kubelet is not None
        return sorted(self.kubelet.plugins[resource].healthy())

    async def prefer(self, resource: str, available: list[str], must: list[str], size: int) -> list[str]:
        assert self.kubelet is not None
        reply = await self.kubelet.plugins[resource].stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)]))
        return list(reply.container_responses[0].deviceIDs) if reply.container_responses else []

    async def allocate(self, resource: str, ids: list[str]) -> bool:
        assert self.kubelet is not None
        try:
            await self.kubelet.plugins[resource].stub.Allocate(api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]))
        except grpc.aio.AioRpcError as exc:  # recorded: an Allocate the plugin refuses is part of the answer
            log.debug("%s: Allocate %s refused: %s", resource, ids, exc)
            return False
        return True


def _container(rng: random.Random, gpu_kinds: tuple[str, ...]) -> list[tuple[str, int]]:
    """One container's (resource, size) in the kubelet's order."""
    gpu = (rng.choice(gpu_kinds), rng.choice([1, 1, 1, 2, 2, 3, 4, 4, 8]))
    nic = (NIC, rng.choice([1, 1, 1, 2, 2, 3, 4, 8]))
    draw = rng.random()
    if draw < 0.35:
        return [gpu, nic]  # NIC after GPU
    if draw < 0.6:
        return [nic, gpu]  # NIC first
    return [gpu] if draw < 0.8 else [nic]


async def record(profile: str, seed: int, steps: int) -> dict[str, Any]:
    """A seeded run on `profile`: every request, its answer and what was allocated."""
    rng = random.Random(f"{seed}/{profile}")  # noqa: S311 - a reproducible workload
    log_: list[dict[str, Any]] = []
    async with Node(profile) as node:
        _, gpu_kinds = PROFILES[profile]
        devices = {r: node.devices(r) for r in (*gpu_kinds, NIC)}
        held: dict[str, set[int]] = {r: set() for r in devices}
        live: list[dict[str, set[int]]] = []
        for number in range(steps):
            advance = 10.0 if rng.random() < 0.05 else 0.1  # past the admission context's time-out now and then
            while live and (rng.random() < 0.4 or len(live) > 6):
                ended = live.pop(rng.randrange(len(live)))
                for resource, taken in ended.items():
                    held[resource] -= taken
            node.clock.t += advance
            got: dict[str, set[int]] = {}
            for resource, size in _container(rng, gpu_kinds):
                free = sorted(set(range(len(devices[resource]))) - held[resource])
                if len(free) < size:
                    break  # the kubelet refuses the rest of the container
                offer = set(free)
                if rng.random() < 0.15 and len(free) > size:  # the topology manager's subset
                    offer = set(rng.sample(free, rng.randint(size, len(free))))
                must = set(rng.sample(sorted(offer), rng.randint(1, size - 1))) if size > 1 and \
                    rng.random() < 0.2 else set()
                ids = devices[resource]
                answer = await node.prefer(resource, [ids[i] for i in sorted(offer)], [ids[i] for i in sorted(must)],
                                           size)
                index = {d: i for i, d in enumerate(ids)}
                chosen = [index[d] for d in answer if d in index]
                valid = len(chosen) == size and set(chosen) <= offer and must <= set(chosen)
                if not valid or rng.random() < 0.05:  # the kubelet fills as it likes, as it may anyway
                    rest = sorted(offer - must)
                    chosen = sorted(must) + rng.sample(rest, size - len(must))
                ok = await node.allocate(resource, [ids[i] for i in chosen])
                log_.append({"c": number, "r": resource, "n": size, "a": mask(offer), "m": sorted(must),
                             "p": [index.get(d, -1) for d in answer], "x": sorted(chosen), "ok": ok,
                             "t": round(node.clock.t, 1)})
                if ok:
                    held[resource] |= set(chosen)
                    got[resource] = set(chosen)
            live.append(got)
    return {"profile": profile, "seed": seed, "steps": steps, "devices": devices, "log": log_}


@dataclass(frozen=True)
class Difference:
    profile: str
    container: int
    resource: str
    expected: list[str]
    got: list[str]


async def replay(recorded: dict[str, Any]) -> tuple[int, list[Difference]]:
    """Send the recorded requests to this code; (answers compared, answers that differ, as sets of IDs)."""
    profile = recorded["profile"]
    compared, differences = 0, []
    async with Node(profile) as node:
        devices = recorded["devices"]
        for resource, ids in devices.items():
            assert node.devices(resource) == ids, f"{profile}: {resource} serves other devices than recorded"
        for entry in recorded["log"]:
            node.clock.t = entry["t"]
            ids = devices[entry["r"]]
            answer = await node.prefer(entry["r"], [ids[i] for i in sorted(unmask(entry["a"]))],
                                       [ids[i] for i in entry["m"]], entry["n"])
            expected = sorted(ids[i] if i >= 0 else "?" for i in entry["p"])
            compared += 1
            if sorted(answer) != expected:
                differences.append(Difference(profile, entry["c"], entry["r"], expected, sorted(answer)))
            ok = await node.allocate(entry["r"], [ids[i] for i in entry["x"]])
            assert ok == entry["ok"], f"{profile} container {entry['c']}: Allocate {'ok' if ok else 'refused'} now"
    return compared, differences


def _commit() -> str:
    import agent

    root = Path(agent.__file__).resolve().parent.parent
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,  # noqa: S607
                              text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record golden GetPreferredAllocation answers as JSON.")
    parser.add_argument("out", type=Path, help="the fixture to write")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--steps", type=int, default=STEPS, help="containers per profile")
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES), help="default: all three")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    log.setLevel(logging.INFO)
    runs = [asyncio.run(record(p, args.seed, args.steps)) for p in args.profile or PROFILES]
    commit = _commit()
    command = " ".join(["python", "tests/placement/golden_answers.py", *(sys.argv[1:] if argv is None else argv)])
    fixture = {"source": {"commit": commit, "command": f"PYTHONPATH=<a worktree at {commit[:7]}> {command}"},
               "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    requests = sum(len(run["log"]) for run in runs)
    log.info("%s: %d requests from %s", args.out, requests, commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
