"""The agent process: one asyncio loop, one `Supervisor` over every enabled subsystem, and the exit code.

`agent.node` opens the node (hardware, mode defaults, node paths), `agent.wiring` builds the subsystems on it;
this module runs them. A subsystem that fails is
restarted with backoff and marked down in `gpu_node_agent_subsystem_up`, so it never takes the others with
it. SIGTERM/SIGINT set `stop`; SIGHUP asks for a hardware rescan. A `FatalError` (a `StartupError` for a
config that cannot run) ends the process with its exit code after one log line; exit decisions live here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from agent import __version__, aio, doctor, wiring
from agent.config import AgentConfig, ConfigError
from agent.http import MetricsServer, Readiness
from agent.node import Node, open_node
from agent.simulate.profiles import UnknownProfileError
from agent.supervisor import FatalError, StartupError, Supervisor
from agent.topology.nccl_xml import TopologyXmlError

log = logging.getLogger(__name__)

# tmpfs on Linux hosts and in containers (64 MiB by default in Docker); mkdtemp makes a private directory in it
RAM_DIRS = ("/dev/shm",)  # noqa: S108
RAM_DIR_MIN_FREE = 64 << 20  # the dgx-h100 tree takes about 16 MiB there


def scratch_parent(simulate: bool, candidates: Sequence[str] = RAM_DIRS) -> str | None:
    """Where the scratch directory goes (None: the default temp dir). With `--simulate` the profile's sysfs tree,
    some 7,000 small files, is written there at every start: seconds on a busy disk, about 0.1 s in memory. So
    the first RAM-backed directory with room."""
    if not simulate:
        return None
    for directory in candidates:
        try:
            free = os.statvfs(directory)
        except OSError:
            continue
        if free.f_bavail * free.f_frsize >= RAM_DIR_MIN_FREE and os.access(directory, os.W_OK | os.X_OK):
            return directory
    return None


async def _heartbeat(readiness: Readiness, stop: asyncio.Event) -> None:
    while not stop.is_set():
        readiness.beat()
        await aio.sleep_or_stop(stop, 1.0)


async def _open_node(cfg: AgentConfig, scratch: Path) -> Node:
    """The node; an unknown profile or an unreadable topology file is a `StartupError`."""
    try:
        return await asyncio.to_thread(open_node, cfg, scratch)
    except (UnknownProfileError, TopologyXmlError) as exc:
        raise StartupError(f"topology: {exc}") from exc
    except OSError as exc:
        raise StartupError(f"topology: cannot read {exc.filename or 'the hardware'}: {exc.strerror or exc}") \
            from exc


def _metrics_server(cfg: AgentConfig, registry: CollectorRegistry, readiness: Readiness) -> MetricsServer:
    try:
        return MetricsServer(cfg.metrics_address, registry, readiness)
    except ValueError as exc:
        raise StartupError(f"metrics address: {exc}") from exc
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {cfg.metrics_address}: {exc.strerror or exc}") from exc


async def _self_check(node: Node, readiness: Readiness) -> None:
    """The machine's own part of `gpu-node-agent doctor` (NVML, sysfs, kernel log, state dir, clock), bounded: one
    log line, and the failing checks named in /readyz while not ready. The kubelet, API and exporter checks are
    left to the subsystems that use them (they log and retry on their own)."""
    checks = await doctor.diagnose(node.cfg, node.hardware, node.scratch, local_only=True, check_s=3.0)
    failing = [c for c in checks if c.status == "fail"]
    log.log(logging.WARNING if failing else logging.INFO, "self-check: %s", doctor.summary(checks))
    readiness.findings("; ".join(f"{c.name}: {c.detail}" for c in failing))


async def run_agent(cfg: AgentConfig, stop: asyncio.Event | None = None,
                    on_ready: Callable[[int], None] | None = None) -> int:
    """Run until `stop` (or a signal); the exit code. `on_ready(port)` is called once the HTTP endpoint listens."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    rescan = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig, action in ((signal.SIGTERM, stop.set), (signal.SIGINT, stop.set), (signal.SIGHUP, rescan.set)):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, action)
            installed.append(sig)
    # simulated sysfs and stand-in kubelet dir (short path)
    scratch = Path(tempfile.mkdtemp(prefix="gna-", dir=scratch_parent(cfg.topology.simulate is not None)))
    try:
        await _run(cfg, stop, rescan, scratch, on_ready)
    except FatalError as exc:
        log.critical("%s; stopping the agent (exit %d)", exc, exc.exit_code)
        return exc.exit_code
    except ConfigError as exc:
        log.critical("invalid configuration: %s (exit 2)", exc)
        return StartupError.exit_code
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("gpu-node-agent stopped")
    return 0


async def _run(cfg: AgentConfig, stop: asyncio.Event, rescan: asyncio.Event, scratch: Path,
               on_ready: Callable[[int], None] | None) -> None:
    disable_created_metrics()  # `_created` twins double the series count and no alert or panel reads them
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Gauge("gpu_node_agent_build_info", "Version of the running agent", ["version"],
          registry=registry).labels(__version__).set(1)
    readiness = Readiness()
    server = _metrics_server(cfg, registry, readiness)
    built: wiring.Wiring | None = None
    try:
        node = await _open_node(cfg, scratch)
        hardware = node.hardware
        await _self_check(node, readiness)
        up = Gauge("gpu_node_agent_subsystem_up", "1 while a subsystem runs, 0 after it failed", ["subsystem"],
                   registry=registry)
        supervisor = Supervisor(stop, up=up, restart_returned=True)
        supervisor.add("heartbeat", lambda s: _heartbeat(readiness, s))
        built = wiring.build(node, registry, readiness=readiness, rescan=rescan)
        for subsystem in built.subsystems:
            supervisor.add(subsystem.name, subsystem.run)
        server.start()
        if on_ready is not None:
            on_ready(server.port)
        log.info("gpu-node-agent %s running: %d GPUs, %d RDMA NICs (%s); %s", __version__,
                 len(hardware.topology.gpus), len(hardware.topology.rdma_nics), hardware.describe(),
                 built.describe())
        await supervisor.run()
    finally:
        if built is not None:  # the shared cluster client outlives every subsystem that uses it
            await built.cluster.aclose()
        server.stop()


def main(cfg: AgentConfig) -> int:
    """Blocking entry point for `gpu-node-agent run`."""
    try:
        return asyncio.run(run_agent(cfg))
    except KeyboardInterrupt:
        return 130
