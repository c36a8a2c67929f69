"""Fixtures for the cluster port tests: the HTTP API double on a fake clock, and a port connected to it."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from tests.fakes import fixtures
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig

NODE = fixtures.NODE  # the node the shared API double serves
AGENT_NS = "gpu-system"


@pytest.fixture
async def port(api: ApiServerDouble, tmp_path: Path):
    """A real lightkube port on the double; `port.registry` holds its request counter."""
    registry = CollectorRegistry()
    cluster: LightkubeCluster = connect(NODE, ApiRequestCounter(registry),
                                        str(write_kubeconfig(tmp_path / "kc", api.url)), timeout=0.5)
    cluster.registry = registry  # type: ignore[attr-defined]
    yield cluster
    await cluster.aclose()
    assert_only_allowed(api.requests, NODE, AGENT_NS)


def count(port: LightkubeCluster, verb: str, code: str) -> float:
    """gpu_node_agent_apiserver_requests_total{verb,code} of the port."""
    return port.registry.get_sample_value("gpu_node_agent_apiserver_requests_total",  # type: ignore[attr-defined]
                                          {"verb": verb, "code": code}) or 0.0
