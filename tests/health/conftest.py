"""Shared fixtures for the health tests: a simulated dgx-h100, a kmsg file, a boot id file, fast services."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config.health import HealthConfig
from agent.health.service import HealthService
from agent.host.links import SysfsLinkPort
from agent.signals import DeviceHealth, DeviceHealthEvent
from agent.simulate import profiles
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import SimulatedNode, build_simulated_node, simulated_nvml

TIMEOUT = 10.0  # generous: "eventually" checks, never timing assertions


def fast_config(kmsg: Path | str, **changes: Any) -> HealthConfig:
    """Health settings with short intervals so tests finish quickly."""
    values: dict[str, Any] = {"kmsg": str(kmsg), "nvml_poll_interval_seconds": 0.05,
                              "nvml_event_timeout_seconds": 0.05, "link_check_interval_seconds": 0.05}
    values.update(changes)
    return HealthConfig(**values)


@pytest.fixture(scope="session")
def dgx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One written dgx-h100 sysfs tree, shared read-only (tests that flip links get a copy through `node`)."""
    root = tmp_path_factory.mktemp("dgx") / "sys"
    build_simulated_node("dgx-h100", root)
    return root


def _node(root: Path, nvml_overrides: Path | None = None) -> SimulatedNode:
    profile = profiles.load_profile("dgx-h100")  # its twin: 18 active NVLinks per GPU, fabric probe completed
    return SimulatedNode(profile=profile, sysfs_root=root, nvml=simulated_nvml(profile, nvml_overrides))


@pytest.fixture
def node(dgx_root: Path) -> SimulatedNode:
    """A dgx-h100 with a fresh simulated NVML on the shared sysfs tree (do not write to it)."""
    return _node(dgx_root)


@pytest.fixture
def writable_node(tmp_path: Path, dgx_root: Path) -> SimulatedNode:
    """A dgx-h100 with its own copy of the sysfs tree, for tests that flip links (copying beats writing), and its
    own NVML override directory (`nvml.overrides_dir`)."""
    root = tmp_path / "sys"
    shutil.copytree(dgx_root, root, symlinks=True)
    (tmp_path / "nvml").mkdir()
    return _node(root, tmp_path / "nvml")


@pytest.fixture
def kmsg_file(tmp_path: Path) -> Path:
    """An empty kernel-log file in /dev/kmsg record format."""
    path = tmp_path / "kmsg"
    path.write_text("")
    return path


@pytest.fixture
def boot_id_file(tmp_path: Path) -> Path:
    """A boot id file (rewrite it to simulate a reboot)."""
    path = tmp_path / "boot_id"
    path.write_text("11111111-2222-3333-4444-555555555555\n")
    return path


@dataclass
class Running:
    """A started HealthService with its device health, registry and stop event."""

    service: HealthService
    device_health: DeviceHealth
    registry: CollectorRegistry
    stop: asyncio.Event
    task: asyncio.Task[None]
    seen: list[DeviceHealthEvent] = field(default_factory=list)

    def drain(self) -> list[DeviceHealthEvent]:
        """Every device flip published so far (also kept in `seen`)."""
        self.seen[:] = self.device_health.since(0) or []
        return self.seen

    def health(self) -> dict[str, bool]:
        """Latest health per device ID from the events seen so far."""
        return {e.device_id: e.healthy for e in self.drain()}

    async def halt(self) -> None:
        """Stop the service and wait for it."""
        self.stop.set()
        await asyncio.wait_for(self.task, TIMEOUT)


@pytest.fixture
async def start_service(tmp_path: Path, boot_id_file: Path) -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    """Start services on a simulated node; every one is stopped at teardown."""
    started: list[Running] = []

    async def start(node: SimulatedNode, config: HealthConfig, *, nvml: Any = None, link_port: Any = None,
                    state_dir: Path | None = None, wait_first_pass: bool = True, **options: Any) -> Running:
        device_health = DeviceHealth()
        registry = CollectorRegistry()
        fast = {"kmsg_file_poll_interval": 0.01, "housekeeping_interval": 0.05, "restart_backoff": (0.05, 0.2)}
        service = HealthService(config, state_dir or tmp_path / "state", node.topology(), nvml or node.nvml,
                                device_health, registry, link_port or SysfsLinkPort(node.sysfs_root),
                                boot_id_path=boot_id_file, **{**fast, **options})
        stop = asyncio.Event()
        running = Running(service, device_health, registry, stop, asyncio.create_task(service.run(stop)))
        started.append(running)
        if wait_first_pass:
            await asyncio.wait_for(service.first_pass_done.wait(), TIMEOUT)
        return running

    yield start
    for running in started:
        if not running.task.done():
            await running.halt()


XID_79 = ("3,{seq},8123456789,-;NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.\n")  # the kernel-log line of a GPU fallen off the bus (/dev/kmsg format)


@pytest.fixture
async def kubelet() -> AsyncIterator[LocalKubelet]:
    """A stand-in kubelet in a short socket directory (unix socket paths are limited to 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="gnah")
    stand_in = LocalKubelet(directory)
    await stand_in.start()
    yield stand_in
    await stand_in.stop()
    shutil.rmtree(directory, ignore_errors=True)
