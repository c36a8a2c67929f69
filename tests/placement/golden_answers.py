"""Golden preferred-allocation answers: record them on one commit, replay them on another, compare.

A seeded random run of containers on a simulated node (profiles `dgx-h100`, `pcie-pairs`, `dgx-h100-mig`; modes
joint, joint with the kubelet's facts, NIC-only: see `golden_node`), driven as the kubelet drives the device
plugin: the agent's `DevicePluginManager` registers with the stand-in kubelet
(`agent.simulate.kubelet.LocalKubelet`) and every call goes over the plugins' unix sockets (gRPC
`GetPreferredAllocation`, then `Allocate`; with the facts, the agent reads the kubelet's PodResources over its
socket as well). Containers ask for GPUs (or MIG slices), RDMA VFs or both, in either order (NIC after GPU, NIC
first), of sizes 1-8; some offers carry `must_include` devices, some are a subset of the
free devices (the topology manager's pick), some allocations ignore the preference (as the kubelet may), and
containers end at random, so the offers run on partly held nodes. The admission context's clock is a fake one
that advances 0.1 s per container (and now and then past the context's 5 s time-out), so a run does not depend on
the machine's speed.

`record` writes each request, the answer and what was allocated; `replay` sends the recorded requests to the code
it runs with, allocates what was allocated then (so one differing answer does not change the later offers), and
lists the answers that differ. Only public interfaces present at both ends are used, so the recording runs on an
older commit as is (run from this tree; the older tree first on the path; a few seconds):

    git -C /work/main worktree add --detach /tmp/base 1b51839
    PYTHONPATH=/tmp/base python tests/placement/golden_answers.py tests/placement/fixtures/answers-1b51839.json

(`PYTHONPATH=.` records this tree's answers; at 78db72d they equal 1b51839's, entry for entry.)

The fixture: `source` (commit, command) and one run per profile and mode, with the devices served per resource
(sorted IDs) and a log whose entries refer to them by index: `{"pod": c, "q": [[resource, size], ...]}` (a
container's requests in the kubelet's order), `{"c", "r", "n", "t", "a", "m", "p", "x"}` (container, resource,
size, the admission clock, the offer as a bit mask, must_include, the answer, what was allocated; an entry
without "a"/"m"/"p" is NVIDIA's stand-in's choice in NIC-only mode; `"ok": false` an Allocate the plugin refused),
`{"end": c}` (the pod ended or failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__:  # imported: tests.placement
    from tests.placement.golden_node import GPU, MIG, MODES, NIC, PROFILES, Node
else:  # run as a script, with another commit's tree first on the path
    from golden_node import GPU, MIG, MODES, NIC, PROFILES, Node  # type: ignore[no-redef,import-not-found]

log = logging.getLogger(__name__)

STEPS = {"joint": 250, "joint-facts": 120, "nic-only": 150}  # containers per profile
SEED = 43
ALIAS = {GPU: "gpu", MIG: "mig", NIC: "nic"}  # the resources in the fixture's entries
RESOURCE = {alias: name for name, alias in ALIAS.items()}


def mask(indices: set[int]) -> str:
    return format(sum(1 << i for i in indices), "x")


def unmask(text: str) -> set[int]:
    value = int(text, 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


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


async def record(profile: str, mode: str, seed: int, steps: int) -> dict[str, Any]:
    """A seeded run on `profile` in `mode`: every request, its answer and what was allocated."""
    rng = random.Random(f"{seed}/{profile}/{mode}")  # noqa: S311 - a reproducible workload
    entries: list[dict[str, Any]] = []
    async with Node(profile, mode) as node:
        started = time.monotonic()
        gpu_kinds = PROFILES[profile][1]
        devices = {r: node.devices(r) for r in (*gpu_kinds, NIC)}
        held: dict[str, set[int]] = {r: set() for r in devices}
        live: dict[int, dict[str, set[int]]] = {}

        def end(number: int) -> None:
            for resource, taken in live.pop(number).items():
                held[resource] -= taken
            node.end_pod(number)
            entries.append({"end": number})

        for number in range(steps):
            while live and (rng.random() < 0.4 or len(live) > 6):
                end(rng.choice(sorted(live)))
            node.clock.t += 10.0 if rng.random() < 0.05 else 0.1  # past the admission context's time-out at times
            container = _container(rng, gpu_kinds)
            node.start_pod(number, dict(container))
            entries.append({"pod": number, "q": [[ALIAS[r], n] for r, n in container]})
            live[number] = got = {}
            for resource, size in container:
                free = sorted(set(range(len(devices[resource]))) - held[resource])
                if len(free) < size:
                    break  # the kubelet refuses the container: the pod fails, its devices are free again
                ids = devices[resource]
                entry: dict[str, Any] = {"c": number, "r": ALIAS[resource], "n": size, "t": round(node.clock.t, 1)}
                if resource in node.ours:
                    offer = set(free)
                    if rng.random() < 0.15 and len(free) > size:  # the topology manager's subset
                        offer = set(rng.sample(free, rng.randint(size, len(free))))
                    must = set(rng.sample(sorted(offer), rng.randint(1, size - 1))) if size > 1 and \
                        rng.random() < 0.2 else set()
                    answer = await node.prefer(resource, [ids[i] for i in sorted(offer)],
                                               [ids[i] for i in sorted(must)], size)
                    index = {d: i for i, d in enumerate(ids)}
                    chosen = [index[d] for d in answer if d in index]
                    valid = len(chosen) == size and set(chosen) <= offer and must <= set(chosen)
                    if not valid or rng.random() < 0.05:  # the kubelet fills as it likes, as it may anyway
                        chosen = sorted(must) + rng.sample(sorted(offer - must), size - len(must))
                    entry |= {"a": mask(offer), "m": sorted(must), "p": [index.get(d, -1) for d in answer]}
                    ok = await node.allocate(resource, [ids[i] for i in chosen])
                    if not ok:
                        entry["ok"] = False  # the plugin refused the Allocate
                else:  # NVIDIA's plugin chose (its preference is not the agent's)
                    chosen, ok = rng.sample(free, size), True
                entries.append(entry | {"x": sorted(chosen)})
                if not ok:
                    break
                held[resource] |= set(chosen)
                got[resource] = set(chosen)
                node.held(number, resource, [ids[i] for i in sorted(chosen)])
            else:
                continue
            end(number)
        log.info("%s %s: %.1f s", profile, mode, time.monotonic() - started)
    return {"profile": profile, "mode": mode, "seed": seed, "steps": steps, "devices": devices, "log": entries}


@dataclass(frozen=True)
class Difference:
    container: int
    resource: str
    expected: list[str]
    got: list[str]


async def replay(recorded: dict[str, Any]) -> tuple[int, list[Difference]]:
    """Send the recorded requests to this code; (answers compared, answers that differ, as sets of IDs)."""
    profile, mode = recorded["profile"], recorded["mode"]
    compared, differences = 0, []
    async with Node(profile, mode) as node:
        devices = recorded["devices"]
        for resource, ids in devices.items():
            assert node.devices(resource) == ids, f"{profile}: {resource} serves other devices than recorded"
        for entry in recorded["log"]:
            if "pod" in entry:
                node.start_pod(entry["pod"], {RESOURCE[r]: n for r, n in entry["q"]})
                continue
            if "end" in entry:
                node.end_pod(entry["end"])
                continue
            node.clock.t = entry["t"]
            resource = RESOURCE[entry["r"]]
            ids = devices[resource]
            chosen = [ids[i] for i in entry["x"]]
            if "p" in entry:
                answer = await node.prefer(resource, [ids[i] for i in sorted(unmask(entry["a"]))],
                                           [ids[i] for i in entry["m"]], entry["n"])
                expected = sorted(ids[i] if i >= 0 else "?" for i in entry["p"])
                compared += 1
                if sorted(answer) != expected:
                    differences.append(Difference(entry["c"], resource, expected, sorted(answer)))
                ok = await node.allocate(resource, chosen)
                assert ok == entry.get("ok", True), f"{profile} {mode} container {entry['c']}: Allocate {ok} now"
                if not ok:
                    continue
            node.held(entry["c"], resource, chosen)
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
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES), help="default: all three")
    parser.add_argument("--mode", action="append", choices=MODES, help="default: all three")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    log.setLevel(logging.INFO)
    runs = [asyncio.run(record(profile, mode, args.seed, STEPS[mode]))
            for mode in args.mode or MODES for profile in args.profile or PROFILES]
    commit = _commit()
    command = " ".join(["python", "tests/placement/golden_answers.py", *(sys.argv[1:] if argv is None else argv)])
    fixture = {"source": {"commit": commit, "command": f"PYTHONPATH=<a worktree at {commit[:7]}> {command}"},
               "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    for run in runs:
        log.info("%s %s: %d answers", run["profile"], run["mode"], sum("p" in e for e in run["log"]))
    log.info("%s: from %s", args.out, commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
