"""One full NIC/PCIe health pass: 8 RDMA NICs x 2 ports + 8 GPUs (goal: p50/p99 <= 5 ms).

Writes the dgx-h100 profile as a sysfs tree, gives each RDMA PF a second port (a copy of port 1, as on a
dual-port ConnectX), and times what the agent does every `--nic-counter-interval`: `NicSysfs.read_pass` (port
state, rate and the judged counters of every port; link width/speed and AER of every GPU and PF and of the
bridges above them) plus `CounterJudge.judge`. A counter grows on one port each trial, so the judge has work.
Files stay open between passes (`OpenFiles`: one `pread` per file). The tree here is plain files; on a node
each IB counter read is a MAD to the HCA, which costs more than the syscall.

    python bench/nic_counter_pass.py --trials 2000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from agent.health.nic_counters import CounterJudge, Thresholds
from agent.host.nic_sysfs import NicSysfs
from agent.host.nvml import SimulatedNvml
from agent.simulate import profiles
from agent.simulate.node import build_simulated_node
from agent.topology.load import load_topology


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(trials: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "sys"
        build_simulated_node("dgx-h100", root)
        topology = load_topology(root, SimulatedNvml(profiles.load_profile("dgx-h100").gpu_uuids).gpu_uuids())
        nics = [n for n in topology.rdma_nics if n.rdma][:8]
        for nic in nics:
            ports = root / "class" / "infiniband" / (nic.rdma or "") / "ports"
            shutil.copytree(ports / "1", ports / "2")
        rdma = [n.rdma for n in nics if n.rdma]
        functions = [g.bus_id for g in topology.gpus] + [n.bus_id for n in nics]
        sysfs, judge = NicSysfs(root), CounterJudge(Thresholds())
        first = sysfs.read_pass(rdma, functions)
        judge.judge(first, 0.0)
        bridges = len(first.links) - len(functions)
        files = sum(len(p.counters) + 2 for p in first.ports) + 4 * len(functions) + 2 * bridges + 3 * len(first.aer)
        bump = root / "class" / "infiniband" / rdma[0] / "ports" / "2" / "counters" / "symbol_error"
        times: list[float] = []
        for trial in range(trials):
            bump.write_text(f"{trial + 1}\n")
            start = time.perf_counter()
            reading = sysfs.read_pass(rdma, functions)
            judge.judge(reading, 10.0 * (trial + 1))
            times.append((time.perf_counter() - start) * 1000)
        print(f"{len(nics)} NICs, {len(first.ports)} ports, {len(topology.gpus)} GPUs, {len(first.links)} PCIe "
              f"functions ({bridges} of them upstream ports), {files} file reads per pass")
        print(f"pass (read + judge): p50 {statistics.median(times):.2f} ms, p99 {_percentile(times, 0.99):.2f} ms, "
              f"max {max(times):.2f} ms over {trials} trials")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    run(parser.parse_args().trials)


if __name__ == "__main__":
    main()
