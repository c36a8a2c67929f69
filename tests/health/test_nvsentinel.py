"""Health events for NVSentinel (issue 42 item 4): the health service sends each new finding and each recovery to a
platform connector over its unix socket (a real gRPC server here), and a connector that hangs delays nothing."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from agent.host.nvsentinel.client import GrpcConnector
from agent.host.nvsentinel.v1 import api_pb2
from agent.simulate.node import SimulatedNode
from tests.fakes.kmsg import xid_record
from tests.fakes.nvsentinel import FakeConnector
from tests.fakes.polling import until
from tests.health.conftest import fast_config

NODE = "dgx-nvs-0"


def outcome(running, name: str) -> float | None:
    return running.registry.get_sample_value("gpu_node_agent_nvsentinel_events_total", {"outcome": name})


async def connector(hold: float = 0.0) -> FakeConnector:
    fake = FakeConnector(Path(tempfile.mkdtemp(prefix="nvs")) / "nvsentinel.sock", hold)
    await fake.start()
    return fake


async def test_an_xid_79_and_its_recovery_reach_the_connector(node: SimulatedNode, kmsg_file: Path, start_service):
    gpu = node.topology().gpus[2]
    fake = await connector()
    try:
        running = await start_service(node, fast_config(kmsg_file), nvsentinel=GrpcConnector(str(fake.socket_path)),
                                      node_name=NODE)
        with kmsg_file.open("a") as log:
            log.write(xid_record(7001, gpu.bus_id, 79, "pid=4242, name=python3, GPU has fallen off the bus."))
        await until(lambda: len(fake.events) == 1)
        (event,) = fake.events
        assert fake.batches[0].version == 1 and event.version == 1
        assert (event.agent, event.componentClass, event.checkName, list(event.errorCode)) == \
            ("gpu-node-agent", "GPU", "GpuXid", ["79"])
        assert (event.isFatal, event.isHealthy, event.recommendedAction) == (True, False, api_pb2.RESTART_BM)
        assert event.processingStrategy == api_pb2.STORE_ONLY and event.nodeName == NODE
        assert [(e.entityType, e.entityValue) for e in event.entitiesImpacted] == \
            [("GPU_UUID", gpu.uuid), ("PCI", gpu.bus_id)]
        assert abs(event.generatedTimestamp.ToNanoseconds() / 1e9 - time.time()) < 60
        assert "fell off the bus" in event.message and "Xid 79" in event.message

        running.service.gpu_reset_done(gpu.uuid)  # what remediation says after it reset the GPU
        await until(lambda: len(fake.events) == 2)
        recovery = fake.events[1]
        assert (recovery.isHealthy, recovery.isFatal, recovery.recommendedAction) == (True, False, api_pb2.NONE)
        assert (recovery.checkName, list(recovery.errorCode)) == ("GpuXid", ["79"])
        assert [e.entityValue for e in recovery.entitiesImpacted] == [gpu.uuid, gpu.bus_id]
        await until(lambda: outcome(running, "sent") == 2)
        assert outcome(running, "failed") == 0 and outcome(running, "dropped") == 0
    finally:
        await fake.stop()


async def test_a_connector_holding_every_call_40s_delays_nothing(node: SimulatedNode, kmsg_file: Path,
                                                                 start_service):
    gpu = node.topology().gpus[1]
    fake = await connector(hold=40.0)
    try:
        running = await start_service(node, fast_config(kmsg_file), nvsentinel=GrpcConnector(str(fake.socket_path)),
                                      node_name=NODE)
        started = time.monotonic()
        with kmsg_file.open("a") as log:
            log.write(xid_record(7001, gpu.bus_id, 79, "pid=4242, name=python3, GPU has fallen off the bus."))
        await until(lambda: running.service.verdict.verdict == "drain" and running.health() == {gpu.uuid: False})
        assert time.monotonic() - started < 5.0
        await until(lambda: fake.calls == 1)
        # more findings while the call hangs: health goes on at once, the events queue behind it
        for seq, other in enumerate(node.topology().gpus[3:6], start=7002):
            with kmsg_file.open("a") as log:
                log.write(xid_record(seq, other.bus_id, 79, "pid=1, name=x, GPU has fallen off the bus."))
        await until(lambda: len([u for u, ok in running.health().items() if not ok]) == 4)
        assert time.monotonic() - started < 5.0
        await until(lambda: outcome(running, "failed") == 1, timeout=15)  # the first call's deadline (5 s)
        halted = time.monotonic()
        await running.halt()  # a call in flight does not hold the stop
        assert time.monotonic() - halted < 3.0
    finally:
        await fake.stop()


async def test_a_full_queue_drops_and_counts(node: SimulatedNode):
    """Past the queue's bound, events are dropped and counted; the observer never blocks."""
    from prometheus_client import CollectorRegistry

    from agent.health.findings import Clears, Finding
    from agent.health.nvsentinel import NvsentinelReporter
    from agent.host.nvsentinel import InMemoryConnector
    from agent.signals import Severity

    registry = CollectorRegistry()
    topology = node.topology()
    reporter = NvsentinelReporter(InMemoryConnector(), node_name=NODE, processing_strategy="STORE_ONLY",
                                  registry=registry, topology=lambda: topology, queue_size=3)
    findings = [Finding(f"xid:{gpu.uuid}", Severity.DRAIN, "fell off the bus", Clears.RESET, (gpu.uuid or "",),
                        code="GpuXid79", hardware=True) for gpu in topology.gpus]
    reporter.observe(findings)  # 8 new findings, room for 3
    assert reporter.queue.qsize() == 3
    assert registry.get_sample_value("gpu_node_agent_nvsentinel_events_total", {"outcome": "dropped"}) == 5
    reporter.observe(findings)  # the same findings again: nothing new
    assert registry.get_sample_value("gpu_node_agent_nvsentinel_events_total", {"outcome": "dropped"}) == 5
