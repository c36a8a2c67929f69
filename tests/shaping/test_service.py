"""The shaping service loop: follows a pods file (annotations added, changed, broken, removed), reports invalid
values as one Warning Event on the pod, and keeps going when the port fails."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.config.shaping import ShapingConfig
from agent.host.tc_simulated import SimulatedTc
from agent.kube.simulated import InMemoryCluster
from agent.pods.source import FilePodSource
from agent.shaping.limits import EGRESS_ANNOTATION, INGRESS_ANNOTATION
from agent.shaping.service import EVENT_REASON, ShapingService
from tests.fakes.polling import until
from tests.shaping.test_engine import INTERNAL


def write_pods(path: Path, annotations: dict[str, str]) -> None:
    """Replace the pods file atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pods": [{"namespace": "team", "name": "trainer", "ips": ["10.244.1.1"],
                                         "uid": "u-1", "annotations": annotations}]}))
    tmp.replace(path)


async def test_follows_annotations_and_reports_bad_ones(tmp_path: Path) -> None:
    tc = SimulatedTc()
    veth = tc.add_link("cali1")
    tc.route("10.244.1.1", veth)
    path = tmp_path / "pods.json"
    write_pods(path, {EGRESS_ANNOTATION: "20M", INGRESS_ANNOTATION: "40M"})
    cluster = InMemoryCluster("node-1")
    source = FilePodSource(str(path), poll_seconds=0.02)
    tc.fail("read")  # the first sync fails as a whole: logged, retried with backoff
    service = ShapingService(ShapingConfig(enabled=True, retry_seconds=0.05), INTERNAL, CollectorRegistry(),
                             source, tc, events=cluster, settle_seconds=0.01, backoff_initial=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await until(lambda: tc.device(veth).download_bps == 40_000_000, "pod shaped")
        assert service.shaper.sync_failures == 1

        write_pods(path, {EGRESS_ANNOTATION: "20M", INGRESS_ANNOTATION: "'; rm -rf /"})
        await until(lambda: tc.device(veth).download_bps is None, "bad ingress value unshapes ingress only")
        assert tc.device(veth).upload_ifb is not None
        await until(lambda: len(cluster.events) == 1, "one Event")
        event = cluster.events[0]
        assert event.reason == EVENT_REASON and event.type == "Warning"
        assert event.involved is not None and (event.involved.kind, event.involved.namespace,
                                               event.involved.name, event.involved.uid) == ("Pod", "team",
                                                                                           "trainer", "u-1")
        assert "'; rm -rf /" in event.message

        write_pods(path, {})
        await until(lambda: not tc.read().devices and not tc.read().ifbs, "annotations removed: limits removed")
        assert len(cluster.events) == 1  # reported once
    finally:
        stop.set()
        await task
        service.close()
