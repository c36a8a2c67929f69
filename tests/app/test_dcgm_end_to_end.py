"""`run --simulate dgx-h100 --dcgm-exporter-url URL`: an Xid DCGM reports withdraws that GPU from the kubelet.

The agent runs as a real process against the test's stand-in kubelet and a simulated dcgm-exporter serving real
exporter text over HTTP; the Xid is injected the way the README shows an operator (`POST /inject`), so the
whole path - scrape, parse, interpret, finding, ListAndWatch, verdict, metrics, remediation - is the product's.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import urllib.request
from pathlib import Path

from agent.simulate.dcgm_exporter import DcgmExporterServer, SimulatedDcgmExporter
from agent.simulate.kubelet import LocalKubelet
from tests.app.agentproc import GPU_RESOURCE, AgentProcess


def _post(url: str) -> int:
    request = urllib.request.Request(url, method="POST")  # noqa: S310 - the local simulated exporter
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - loopback http only
        return response.status


def _ok_scrapes(text: str) -> float:
    found = re.search(r'^gpu_node_agent_dcgm_scrapes_total\{result="ok"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def test_an_xid_from_dcgm_withdraws_the_gpu_and_is_counted_once():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    exporter = SimulatedDcgmExporter.for_profile("dgx-h100", xid_metrics=("gauge", "total"))
    gpu = exporter.gpus[3]
    kubelet = LocalKubelet(directory)
    await kubelet.start()
    with DcgmExporterServer(exporter) as server:
        agent = AgentProcess(directory, "--dcgm-exporter-url", server.url, "--dcgm-scrape-interval", "0.2")
        try:
            await kubelet.wait_for(lambda: GPU_RESOURCE in kubelet.plugins
                                   and kubelet.plugins[GPU_RESOURCE].health().get(gpu.uuid) == "Healthy", timeout=60)
            # the baseline scrape is taken before the fault
            await kubelet.wait_for(lambda: 'gpu_node_agent_dcgm_scrapes_total{result="ok"}' in agent.metrics(),
                                   timeout=30)
            base = server.url.rsplit("/", 1)[0]
            assert await asyncio.to_thread(_post, f"{base}/inject?gpu=3&xid=119") == 204
            await kubelet.wait_for(lambda: kubelet.plugins[GPU_RESOURCE].health().get(gpu.uuid) == "Unhealthy",
                                   timeout=30)
            others = {k: v for k, v in kubelet.plugins[GPU_RESOURCE].health().items() if k != gpu.uuid}
            assert set(others.values()) == {"Healthy"}
            # several more scrapes of the same total (counted, not slept for: a loaded machine scrapes less often)
            after = _ok_scrapes(await asyncio.to_thread(agent.metrics)) + 3
            await kubelet.wait_for(lambda: _ok_scrapes(agent.metrics()) >= after, timeout=60)
            text = await asyncio.to_thread(agent.metrics)
            assert f'uuid="{gpu.uuid}",xid="119"}} 1.0' in text  # GSP RPC timeout: a node drain
            assert 'gpu_node_agent_node_verdict{verdict="drain"} 1.0' in text
            assert 'gpu_node_agent_health_check_up{check="dcgm"} 1.0' in text
            await kubelet.wait_for(lambda: any("would cordon" in m and "GpuXid119" in m
                                               for m in agent.dry_run_decisions()), timeout=30)
        finally:
            code = agent.stop()
            await kubelet.stop()
    assert code == 0, agent.log_tail()
