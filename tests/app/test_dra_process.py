"""A real `gpu-node-agent run --simulate dgx-h100 --dra` process: the contract flags, registration with a
stand-in kubelet over the unix sockets, slices published (counted), a bad claim answered, a clean stop."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.agentproc import AgentProcess
from tests.fakes.kubelet_dra import DraKubelet


@pytest.fixture
def short_root() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="gna-drap"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _sample(metrics: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_dra_flags_registration_and_a_refused_claim(short_root: Path) -> None:
    (short_root / "dp").mkdir()
    (short_root / "registry").mkdir()
    agent = AgentProcess(short_root / "dp", "--dra", "--dra-driver-name", "gpunodeagent.io",
                         "--plugin-registry-dir", str(short_root / "registry"),
                         "--dra-plugin-dir", str(short_root / "plugin"), "--cdi-spec-dir", str(short_root / "cdi"),
                         "--state-dir", str(short_root / "state"))
    kubelet = DraKubelet(short_root / "registry")
    try:
        plugin = await kubelet.register("gpunodeagent.io", timeout=60)
        assert plugin.info.endpoint == str(short_root / "plugin" / "dra.sock")

        for _ in range(600):  # a guard against hangs, not a timing assertion
            text = await asyncio.to_thread(agent.metrics)
            if _sample(text, "gpu_node_agent_dra_slice_publishes_total", 'result="changed"') >= 1:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"slices never published:\n{agent.log_tail()}")

        response = await plugin.prepare(("default", "0f6b7f1e-1111-4a5b-9c3d-000000000009", "no-such-claim"))
        assert "not found" in response.claims["0f6b7f1e-1111-4a5b-9c3d-000000000009"].error
        text = await asyncio.to_thread(agent.metrics)
        assert _sample(text, "gpu_node_agent_dra_claims_total", 'call="prepare",result="error"') == 1
        assert 'gpu_node_agent_subsystem_up{subsystem="dra"} 1.0' in text
    finally:
        await kubelet.close()
        code = agent.stop()
    assert code == 0, agent.log_tail()
    assert not (short_root / "registry" / "gpunodeagent.io-reg.sock").exists()
