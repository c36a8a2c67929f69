"""DRA driver costs on dgx-h100 (72 devices): one slice publish through lightkube to the API double, an unchanged
republish (the minute resync), and NodePrepareResources / NodeUnprepareResources round trips over the unix socket
from a stand-in kubelet (the claim GET included, the CDI spec and the record written and fsynced).

With `--profile dgx-h100-mig` (4 GPUs + 28 MIG devices + 64 VFs) each claim is 1 MIG device + 1 VF: its CDI
edits add the parent's node and the capability nodes read from a `mig-minors` file of 8 GPUs (1,082 lines).

    python bench/dra_prepare.py [--claims N] [--profile dgx-h100-mig]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.fakes: the API double and the kubelet

from allocation_latency import percentile  # run as a script, bench/ is on sys.path
from prometheus_client import CollectorRegistry

from agent.config.model import DraConfig
from agent.dra.service import DraService
from agent.kube.cluster import connect
from agent.kube.metrics import ApiRequestCounter
from agent.simulate import nvidia_caps
from agent.simulate.node import simulated_topology
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.kubelet_dra import DraKubelet

NODE = "bench-node"
DRIVER = "gpunodeagent.io"


def _ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 0.5) * 1e3:.2f} ms, p99 {percentile(values, 0.99) * 1e3:.2f} ms"


async def main(claims: int, profile: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="gna-bench"))
    api = ApiServerDouble(FakeClock(), NODE)
    await api.start()
    port = connect(NODE, ApiRequestCounter(CollectorRegistry()), str(write_kubeconfig(root / "kc", api.url)))
    cfg = DraConfig(enabled=True, plugin_registry_dir=str(root / "reg"), plugin_dir=str(root / "dra"),
                    cdi_spec_dir=str(root / "cdi"))
    minors_file = nvidia_caps.write_mig_minors(root / "proc", range(8))
    service = DraService(cfg, port, simulated_topology(profile, root / "sys"), root / "state",
                         mig_minors=str(minors_file))
    try:
        started = time.perf_counter()
        await service.publish()
        first = time.perf_counter() - started
        resync = []
        for _ in range(50):
            started = time.perf_counter()
            await service.publish()
            resync.append(time.perf_counter() - started)
        print(f"publish {len(service.devices)} devices: first {first * 1e3:.1f} ms; unchanged resync {_ms(resync)}")

        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        kubelet = DraKubelet(root / "reg")
        plugin = await kubelet.register(DRIVER)
        kind = "mig" if any(d.kind == "mig" for d in service.devices.values()) else "gpu"
        gpus = [n for n, d in service.devices.items() if d.kind == kind]
        vfs = [n for n, d in service.devices.items() if d.kind == "rdma"]
        prepare, unprepare = [], []
        for i in range(claims):
            uid = f"0f6b7f1e-0000-4000-8000-{i:012x}"
            api.put_claim({"metadata": {"name": f"c{i}", "namespace": "default", "uid": uid},
                           "status": {"allocation": {"devices": {"results": [
                               {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": gpus[i % len(gpus)]},
                               {"request": "vf", "driver": DRIVER, "pool": NODE, "device": vfs[i % len(vfs)]}]}}}})
            started = time.perf_counter()
            answer = (await plugin.prepare(("default", uid, f"c{i}"))).claims[uid]
            prepare.append(time.perf_counter() - started)
            assert not answer.error, answer.error
            started = time.perf_counter()
            await plugin.unprepare(("default", uid, f"c{i}"))
            unprepare.append(time.perf_counter() - started)
        print(f"NodePrepareResources (1 {kind.upper()} + 1 VF, claim GET, CDI spec, record): {_ms(prepare)}")
        print(f"NodeUnprepareResources: {_ms(unprepare)}")
        await kubelet.close()
        stop.set()
        await task
    finally:
        await port.aclose()
        await api.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--profile", default="dgx-h100", help="simulated profile (dgx-h100-mig: MIG claims)")
    logging.basicConfig(level=logging.WARNING)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.claims, arguments.profile))
