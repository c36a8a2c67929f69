"""Shared pieces of the DRA tests: the simulated profiles' topologies, the manifests' DeviceClasses, a port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from agent.simulate.node import simulated_topology
from agent.topology.model import Topology
from tests.fakes import fixtures
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.kubelet_dra import DraKubelet

if TYPE_CHECKING:
    from tests.dra.test_plugin import Node

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpunodeagent.io"
RDMA_RESOURCE = "gpunodeagent.io/sriov_rdma"
NODE = fixtures.NODE
PROFILES = ("dgx-h100", "pcie-pairs", "vm-flat")
_TOPOLOGIES: dict[str, Topology] = {}


def profile_topology(name: str, tmp_path_factory: pytest.TempPathFactory) -> Topology:
    """A profile's topology read back from its simulated sysfs tree (and NCCL XML), once per session."""
    if name not in _TOPOLOGIES:
        _TOPOLOGIES[name] = simulated_topology(name, tmp_path_factory.mktemp(name))
    return _TOPOLOGIES[name]


def manifests(relative: str) -> list[dict[str, Any]]:
    """The YAML documents of a file under deploy/."""
    return [doc for doc in yaml.safe_load_all((ROOT / "deploy" / relative).read_text()) if doc]


def device_classes() -> dict[str, dict[str, Any]]:
    """The DeviceClasses we ship, by name."""
    return {doc["metadata"]["name"]: doc for doc in manifests("dra/deviceclasses.yaml")}


def claim_template(name: str) -> dict[str, Any]:
    """An example ResourceClaimTemplate's claim spec, as a claim."""
    template = next(d for d in manifests("dra/examples/resourceclaimtemplates.yaml") if d["metadata"]["name"] == name)
    return {"spec": template["spec"]["spec"]}


@pytest.fixture
async def port(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[LightkubeCluster]:
    """The real lightkube port on the API double; only requests the RBAC grants are allowed."""
    cluster = connect(NODE, ApiRequestCounter(CollectorRegistry()), str(write_kubeconfig(tmp_path / "kc", api.url)),
                      timeout=2.0)
    yield cluster
    await cluster.aclose()
    assert_only_allowed(api.requests, NODE, "gpu-system")


@pytest.fixture
async def kubelet(node: Node) -> AsyncIterator[DraKubelet]:
    """The stand-in kubelet on the registry directory of the module's own `node` fixture."""
    stand_in = DraKubelet(Path(node.cfg.plugin_registry_dir))
    yield stand_in
    await stand_in.close()
