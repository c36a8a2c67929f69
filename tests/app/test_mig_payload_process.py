"""`run --simulate dgx-h100-mig --mig-strategy mixed --pass-device-specs`: a MIG device's Allocate payload, as the
test's kubelet receives it over gRPC, has what NVIDIA's plugin passes on a real node: the parent's
`/dev/nvidia<minor>` and the capability nodes of its GPU and compute instance, their minors read from the
simulated node's driver `mig-minors` file (internal/rm/nvml_devices.go `GetPaths`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_nvml
from agent.simulate.profiles import load_profile
from tests.app.agentproc import AgentProcess

MIG = "nvidia.com/mig-1g.10gb"
CAPS_PER_GPU = 15 * 9  # the driver's numbering: per GPU 15 GPU instances, each followed by its 8 compute instances


def _expected_nodes(mig_uuid: str) -> tuple[str, set[str]]:
    """The parent's node and the two capability nodes NVIDIA's plugin passes for this MIG device."""
    nvml = simulated_nvml(load_profile("dgx-h100-mig"))
    minors = nvml.gpu_minors()
    for bus_id, migs in nvml.mig_devices().items():
        for mig in migs:
            if mig.uuid == mig_uuid:
                minor = minors[bus_id]
                gi = 3 + minor * CAPS_PER_GPU + mig.gpu_instance * 9  # `config 1`, `monitor 2` come first
                ci = gi + 1 + mig.compute_instance
                return f"/dev/nvidia{minor}", {f"/dev/nvidia-caps/nvidia-cap{gi}", f"/dev/nvidia-caps/nvidia-cap{ci}"}
    raise AssertionError(f"{mig_uuid} is not a MIG device of the profile")


async def test_a_mig_device_gets_its_parent_and_both_capability_nodes() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    kubelet = LocalKubelet(directory)
    await kubelet.start()
    agent = AgentProcess(directory, "--mig-strategy", "mixed", "--pass-device-specs", "--kmsg", "",
                         profile="dgx-h100-mig")
    try:
        await kubelet.wait_for(lambda: MIG in kubelet.plugins and kubelet.plugins[MIG].lists > 0, timeout=60)
        for _ in range(3):  # three devices, on more than one GPU instance and parent
            ids = (await kubelet.admit({MIG: 1}))[MIG]
            paths = {d.host_path: d.container_path for d in kubelet.responses[MIG].devices}
            assert all(host == container for host, container in paths.items())
            parent, caps = _expected_nodes(ids[0])
            assert parent in paths, (paths, agent.log_tail())
            got_caps = {p for p in paths if p.startswith("/dev/nvidia-caps/")}
            assert got_caps == caps and len(got_caps) == 2, (paths, agent.log_tail())
            assert not [p for p in paths if p.startswith("/dev/nvidia") and p[11:].isdigit() and p != parent]
    finally:
        code = agent.stop()
        await kubelet.stop()
    assert code == 0, agent.log_tail()
