"""The agent process: one asyncio loop that supervises every enabled subsystem.

Each subsystem is a coroutine `run(stop)` that returns once `stop` is set. The supervisor restarts one that
fails, with backoff, and marks it down in `gpu_node_agent_subsystem_up`, so a broken subsystem never takes the
others with it. SIGTERM/SIGINT set `stop`; SIGHUP asks for a hardware rescan. Exit decisions live here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from agent import __version__, aio
from agent.config import AgentConfig
from agent.host.hardware import Hardware, open_hardware
from agent.http import MetricsServer, Readiness

log = logging.getLogger(__name__)

RunFn = Callable[[asyncio.Event], Awaitable[None]]


class Supervisor:
    """Runs named subsystems until `stop`; restarts a failed one with capped exponential backoff."""

    def __init__(self, stop: asyncio.Event, registry: CollectorRegistry, *, backoff_initial: float = 1.0,
                 backoff_max: float = 60.0, grace: float = 10.0) -> None:
        self.stop = stop
        self._subsystems: dict[str, RunFn] = {}
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._grace = grace
        self.up = Gauge("gpu_node_agent_subsystem_up", "1 while a subsystem runs, 0 after it failed",
                        ["subsystem"], registry=registry)
        self.failures: dict[str, int] = {}

    def add(self, name: str, run: RunFn) -> None:
        """Register a subsystem before `run()`."""
        self._subsystems[name] = run
        self.failures[name] = 0

    async def _guard(self, name: str, run: RunFn) -> None:
        delay = self._backoff_initial
        while not self.stop.is_set():
            self.up.labels(name).set(1)
            try:
                await run(self.stop)
                if self.stop.is_set():
                    return
                log.error("subsystem %s returned before shutdown; restarting it in %.0fs", name, delay)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("subsystem %s failed; the others keep running; restarting it in %.0fs",
                              name, delay)
            self.failures[name] += 1
            self.up.labels(name).set(0)
            await aio.sleep_or_stop(self.stop, delay)
            delay = min(delay * 2, self._backoff_max)

    async def run(self) -> None:
        """Run every subsystem until `stop`, then give them `grace` seconds to finish before cancelling."""
        tasks = [asyncio.create_task(self._guard(name, fn), name=name) for name, fn in self._subsystems.items()]
        await self.stop.wait()
        _, pending = await asyncio.wait(tasks, timeout=self._grace)
        for task in pending:
            log.warning("subsystem %s did not stop within %.0fs; cancelling it", task.get_name(), self._grace)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _heartbeat(readiness: Readiness, stop: asyncio.Event) -> None:
    while not stop.is_set():
        readiness.beat()
        await aio.sleep_or_stop(stop, 1.0)


def _resolve(cfg: AgentConfig) -> AgentConfig:
    """Settings whose default depends on the mode: GPUs are served by default only on a simulated node."""
    if cfg.device_plugin.serve_gpus is None:
        serve = cfg.topology.simulate is not None
        cfg = dataclasses.replace(cfg, device_plugin=dataclasses.replace(cfg.device_plugin, serve_gpus=serve))
    return cfg


async def run_agent(cfg: AgentConfig, stop: asyncio.Event | None = None,
                    on_ready: Callable[[int], None] | None = None) -> int:
    """Run until `stop` (or a signal). `on_ready(port)` is called once the HTTP endpoint listens."""
    from agent import subsystems

    cfg = _resolve(cfg)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    rescan = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig, action in ((signal.SIGTERM, stop.set), (signal.SIGINT, stop.set), (signal.SIGHUP, rescan.set)):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, action)
            installed.append(sig)

    disable_created_metrics()  # `_created` twins double the series count and no alert or panel reads them
    scratch = Path(tempfile.mkdtemp(prefix="gna-"))  # simulated sysfs and stand-in kubelet dir (short path)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Gauge("gpu_node_agent_build_info", "Version of the running agent", ["version"],
          registry=registry).labels(__version__).set(1)
    readiness = Readiness()
    server = MetricsServer(cfg.metrics_address, registry, readiness)
    ctx: subsystems.Context | None = None
    try:
        hardware: Hardware = await asyncio.to_thread(open_hardware, cfg.topology, scratch / "sys")
        supervisor = Supervisor(stop, registry)
        supervisor.add("heartbeat", lambda s: _heartbeat(readiness, s))
        ctx = subsystems.Context(cfg=cfg, hardware=hardware, registry=registry, readiness=readiness, rescan=rescan,
                                 scratch=scratch, stop=stop)
        subsystems.install(supervisor, ctx)
        server.start()
        if on_ready is not None:
            on_ready(server.port)
        log.info("gpu-node-agent %s running: %d GPUs, %d RDMA NICs (%s)", __version__, len(hardware.topology.gpus),
                 len(hardware.topology.rdma_nics), hardware.describe())
        await supervisor.run()
    finally:
        if ctx is not None:  # shared clients (the cluster port) outlive every subsystem that uses them
            await ctx.aclose()
        server.stop()
        for sig in installed:
            loop.remove_signal_handler(sig)
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("gpu-node-agent stopped")
    return ctx.exit_code if ctx is not None else 0


def main(cfg: AgentConfig) -> int:
    """Blocking entry point for `gpu-node-agent run`."""
    try:
        return asyncio.run(run_agent(cfg))
    except KeyboardInterrupt:
        return 130
