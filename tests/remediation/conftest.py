"""Fixtures: the HTTP API double and fake clock (tests/fakes), and a harness running `RemediationService` on them."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config.remediation import RemediationConfig
from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from agent.remediation import RemediationService
from agent.remediation.maintenance import urllib_fetch
from agent.remediation.preflight import PreflightCheck
from agent.signals import Latest, NodeVerdict
from tests.fakes import fixtures
from tests.fakes.allowed import assert_only_allowed as check_allowed
from tests.fakes.apiserver import ApiServerDouble, Request, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until

NODE = fixtures.NODE  # the node the shared API double serves
AGENT_NS = "gpu-system"
AGENT_POD = "gpu-node-agent-abcde"


API_TIMEOUT = 2.0  # seconds; the API double answers at once unless a test scripts a hang


def make_config(**overrides: Any) -> RemediationConfig:
    base = RemediationConfig(enabled=True, pod_name=AGENT_POD, pod_namespace=AGENT_NS, slots=2,
                             healthy_window_seconds=600.0, preflight_taint="")
    return dataclasses.replace(base, **overrides)


def assert_only_allowed(requests: list[Request]) -> None:
    """Every request is one the RBAC rules grant, and nothing lists or watches cluster-wide."""
    check_allowed(requests, NODE, AGENT_NS)


class Harness:
    """The service under test, its double, clock and metrics."""

    def __init__(self, api: ApiServerDouble, clock: FakeClock, kubeconfig: Path) -> None:
        self.api = api
        self.clock = clock
        self.kubeconfig = kubeconfig
        self.registry = CollectorRegistry()
        self.requests = ApiRequestCounter(self.registry)
        self.queue: Latest[NodeVerdict] = Latest()
        self.service: RemediationService | None = None
        self.cluster: LightkubeCluster | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.activity: list[Callable[[], object]] = []  # other servers the agent talks to (the kubelet's calls)
        self.fetching = 0  # metadata fetches in flight (each runs in a worker thread the loop cannot see)

    async def start(self, config: RemediationConfig | None = None,
                    checks: tuple[PreflightCheck, ...] = (), *, api_timeout: float = API_TIMEOUT,
                    **kwargs: Any) -> RemediationService:
        config = config or make_config()
        self.cluster = connect(NODE, self.requests, str(self.kubeconfig), timeout=api_timeout)
        self._stop = asyncio.Event()
        self.service = RemediationService(config, NODE, self.cluster, self.queue, self.registry, pod_name=AGENT_POD,
                                          pod_namespace=AGENT_NS, clock=self.clock, rng=random.Random(7),  # noqa: S311 - jitter
                                          preflight_checks=checks,
                                          **{"metadata_fetch": self._counted_fetch, **kwargs})
        self._task = asyncio.create_task(self.service.run(self._stop))
        await self.settle()
        return self.service

    async def _counted_fetch(self, method: str, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        """The product's metadata fetch, counted so that `settle` waits for one in flight."""
        self.fetching += 1
        try:
            return await urllib_fetch(method, url, headers)
        finally:
            self.fetching -= 1

    async def stop(self) -> None:
        if self._task is not None:
            self._stop.set()
            await asyncio.wait_for(self._task, 30)  # a hang guard, sized for a loaded machine
            self._task = None
        if self.cluster is not None:
            await self.cluster.aclose()
            self.cluster = None

    async def restart(self, config: RemediationConfig | None = None, **kwargs: Any) -> RemediationService:
        """A new agent process: fresh service, metrics and client; the cluster keeps its state."""
        await self.stop()
        self.registry = CollectorRegistry()
        self.requests = ApiRequestCounter(self.registry)
        return await self.start(config, **kwargs)

    async def verdict(self, verdict: NodeVerdict) -> None:
        self.queue.set(verdict)
        await self.settle()

    async def settle(self) -> None:
        """Wait until no request or metadata fetch is in flight and nothing changed for a few polls (real time,
        never asserted). A fetch runs in a worker thread: on a loaded machine it outlasted the quiet polls, the
        clock moved on meanwhile and the maintenance poll fell behind the fake time the test expected."""
        last: tuple[Any, ...] | None = None
        stable = 0
        for _ in range(2000):
            await asyncio.sleep(0.003)
            snapshot = (len(self.api.requests), self.api.inflight, self.fetching, len(self.clock._sleepers),
                        self.clock.next_deadline(), *(count() for count in self.activity))
            if snapshot == last and self.api.inflight == 0 and self.fetching == 0:
                stable += 1
                if stable >= 6:
                    return
            else:
                stable = 0
            last = snapshot

    async def advance(self, seconds: float) -> None:
        await self.clock.advance(seconds, self.settle)

    async def until(self, predicate: Callable[[], bool], what: str = "condition") -> None:
        """Poll `predicate` (a guard against hangs, not a timing assertion: sized for a loaded machine)."""
        await until(predicate, what, timeout=20.0)

    def actions(self, action: str, result: str) -> float:
        return self.registry.get_sample_value("gpu_node_agent_remediation_actions_total",
                                              {"action": action, "result": result}) or 0.0

    def api_count(self, verb: str, code: str) -> float:
        return self.registry.get_sample_value("gpu_node_agent_apiserver_requests_total",
                                              {"verb": verb, "code": code}) or 0.0

    def event_reasons(self) -> list[str]:
        return [e["reason"] for e in self.api.events.values()]

    def mark(self) -> int:
        return len(self.api.requests)

    def writes(self, since: int = 0) -> list[Request]:
        """Requests that change something, from request number `since` on (see `mark`)."""
        return [r for r in self.api.requests[since:] if r.method != "GET"]


@pytest.fixture
async def harness(api: ApiServerDouble, clock: FakeClock, tmp_path: Path):
    h = Harness(api, clock, write_kubeconfig(tmp_path / "kubeconfig", api.url))
    yield h
    await h.stop()
    assert_only_allowed(api.requests)
    await api.stop()
    # every loop the service started has ended: the test-wide leak guard (tests/conftest.py) checks it


from tests.remediation.rig import rig  # noqa: E402, F401 - the device-scoped node fixture (health, kubelet, ownership)
