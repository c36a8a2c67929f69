"""The shaping reconcile against the simulated tc port: convergence, pending pods, conflicts, restart, removal,
metrics; and the limits from annotations and namespace defaults."""

from __future__ import annotations

import ipaddress
import time

import pytest
from prometheus_client import CollectorRegistry

from agent.config import ConfigError
from agent.config.load import load
from agent.config.pods import DEFAULT_INTERNAL_CIDRS
from agent.config.shaping import Limits, parse_bandwidth, parse_defaults
from agent.host.tc import exemptions
from agent.host.tc_simulated import SimulatedTc
from agent.kube.model import PodView
from agent.pods.kube import addressed
from agent.pods.model import PodListError, make_pod, parse_pods
from agent.shaping.collector import ShapingCollector
from agent.shaping.engine import Shaper, ifb_name
from agent.shaping.limits import EGRESS_ANNOTATION, INGRESS_ANNOTATION, resolve

INTERNAL = [ipaddress.ip_network(c) for c in DEFAULT_INTERNAL_CIDRS]


@pytest.mark.parametrize(("text", "bps"), [("100M", 10**8), ("1G", 10**9), ("20M", 2 * 10**7), ("1.5k", 1500),
                                           ("1e6", 10**6), ("10Mi", 10 * 2**20), ("1500m", 2), ("1k", 1000)])
def test_quantities_are_bits_per_second(text, bps):
    if bps < 1000:
        with pytest.raises(ValueError, match="small"):
            parse_bandwidth(text)
    else:
        assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["abc", "-5M", "2P", "10 M", "1MB", "", "0x10", "$(reboot)", "1" * 100,
                                  # issue 27: a million-digit integer (30 s, the loop stalled), decimal.Overflow
                                  "1e999999", "1e9999999", "1E+999999999", "1e-9999999", "9" * 60 + "e99", "0e99999"])
def test_bad_quantities_are_refused_with_a_reason(text):
    started = time.process_time()  # this process's CPU: not inflated by other work on a loaded machine
    with pytest.raises(ValueError) as info:
        parse_bandwidth(text)
    assert len(str(info.value)) < 200
    assert time.process_time() - started < 1  # the million-digit integer took 30 s of CPU


def test_each_direction_stands_alone():
    defaults = parse_defaults({"team": {"egress": "50M", "ingress": "100M"}, "lab": {"ingress": "1G"}})
    assert resolve("team", {}, defaults)[0] == Limits(50 * 10**6, 100 * 10**6)
    assert resolve("team", {EGRESS_ANNOTATION: "10M"}, defaults)[0] == Limits(10**7, 10**8)
    assert resolve("lab", {}, defaults)[0] == Limits(None, 10**9)
    assert resolve("other", {}, defaults)[0] == Limits()
    limits, problems = resolve("team", {INGRESS_ANNOTATION: "lots"}, defaults)
    assert limits == Limits(50 * 10**6, None)  # invalid: that direction unshaped, never the default
    assert [(p.direction, p.annotation, p.value) for p in problems] == [("ingress", INGRESS_ANNOTATION, "lots")]


def test_config_section_and_its_checks(tmp_path):
    cfg = load(None, {"GPU_NODE_AGENT_SHAPING": "true"})
    assert cfg.shaping.enabled and cfg.shaping.namespace_defaults == {}
    path = tmp_path / "config.yaml"
    path.write_text("shaping:\n  namespaceDefaults:\n    team-a: {egress: 50M, ingress: 100M}\n")
    cfg = load(None, {"GPU_NODE_AGENT_CONFIG": str(path)})
    assert cfg.shaping.namespace_defaults == {"team-a": {"egress": "50M", "ingress": "100M"}}
    path.write_text("shaping:\n  namespaceDefaults:\n    team-a: {egress: fast}\n")
    with pytest.raises(ConfigError, match=r"namespaceDefaults.team-a.egress"):
        load(None, {"GPU_NODE_AGENT_CONFIG": str(path)})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_defaults({"team": {"upload": "1M"}})


def test_pods_file_takes_optional_uid_and_annotations():
    pods = parse_pods({"pods": [{"namespace": "a", "name": "p", "ips": ["10.0.0.1"], "uid": "u-1",
                                 "annotations": {EGRESS_ANNOTATION: "5M"}},
                                {"namespace": "a", "name": "q", "ips": []}]})
    assert pods[0].uid == "u-1" and pods[0].annotation_map == {EGRESS_ANNOTATION: "5M"}
    assert pods[1].uid == "" and pods[1].annotations == ()
    for bad in ({"uid": 5}, {"annotations": ["x"]}, {"annotations": {"k": 1}}):
        with pytest.raises(PodListError):
            parse_pods({"pods": [{"namespace": "a", "name": "p", **bad}]})


# --- reconcile ---------------------------------------------------------------------------------------------------


class Node:
    """A simulated node: two routed veths, a bridge with one port, the uplink."""

    def __init__(self) -> None:
        self.tc = SimulatedTc()
        self.up = self.tc.add_link("eth0", "")
        self.cali1 = self.tc.add_link("cali1")
        self.cali2 = self.tc.add_link("cali2")
        self.bridge = self.tc.add_link("cni0", "bridge")
        self.veth3 = self.tc.add_link("veth3")
        self.tc.route("10.244.1.1", self.cali1)
        self.tc.route("fd00::1", self.cali1)
        self.tc.route("10.244.1.2", self.cali2)
        self.tc.route("10.244.2.3", self.bridge)


def limited(name: str, ip: str, egress: str | None = "20M", ingress: str | None = "40M", uid: str = "") -> object:
    annotations = {k: v for k, v in ((EGRESS_ANNOTATION, egress), (INGRESS_ANNOTATION, ingress)) if v is not None}
    return make_pod("team", name, [ip], uid or f"uid-{name}", annotations)


def test_converges_on_add_change_and_remove():
    node = Node()
    shaper = Shaper(node.tc, INTERNAL, {})
    pod = limited("a", "10.244.1.1")
    report = shaper.sync([pod, make_pod("team", "plain", ["10.244.1.2"])])
    assert {k: p.state for k, p in report.pods.items()} == {("team", "a"): "shaped"}
    state = node.tc.read()
    assert state.devices[node.cali1].download_bps == 40 * 10**6
    assert state.devices[node.cali1].download_exempt == frozenset(exemptions(INTERNAL, source=True))
    assert state.devices[node.cali1].upload_exempt == frozenset(exemptions(INTERNAL, source=False))
    assert state.ifbs[ifb_name(pod)].rate_bps == 20 * 10**6 and node.cali2 not in state.devices

    node.tc.calls.clear()
    shaper.sync([pod])
    assert node.tc.calls == []  # nothing differs: nothing changed

    shaper.sync([limited("a", "10.244.1.1", ingress="80M")])
    assert node.tc.calls == [f"set_download_rate {node.cali1}"]  # a new limit is changed in place

    node.tc.calls.clear()
    report = shaper.sync([limited("a", "10.244.1.1", egress=None, ingress="80M")])
    assert node.tc.calls == [f"unshape_upload {node.cali1}", f"delete_ifb {ifb_name(pod)}"]  # redirect first
    assert not node.tc.read().ifbs

    shaper.sync([])
    assert node.tc.read().devices == {} and node.tc.read().ifbs == {}


def test_a_restart_adopts_what_is_there():
    node = Node()
    pods = [limited("a", "10.244.1.1"), limited("b", "10.244.1.2", ingress=None)]
    Shaper(node.tc, INTERNAL, {}).sync(pods)
    node.tc.calls.clear()
    restarted = Shaper(node.tc, INTERNAL, {})
    assert restarted.sync(pods).count("shaped") == 2
    assert node.tc.calls == []
    other_internal = Shaper(node.tc, [ipaddress.ip_network("10.0.0.0/8")], {})
    other_internal.sync(pods)  # the internal set changed while the agent was down: filters rewritten
    assert sorted(node.tc.calls) == sorted([f"shape_download {node.cali1}", f"shape_upload {node.cali1}",
                                            f"shape_upload {node.cali2}"])


def test_pending_pods_are_retried_and_bridge_ports_found():
    node = Node()
    shaper = Shaper(node.tc, INTERNAL, {})
    pods = [limited("bridged", "10.244.2.3"), limited("later", "10.244.9.9")]
    report = shaper.sync(pods)
    assert report.count("pending") == 2 and node.tc.read().devices == {}
    node.tc.bridge_entry(node.bridge, "10.244.2.3", "02:00:00:00:00:03", node.veth3)
    late = node.tc.add_link("cali9")
    node.tc.route("10.244.9.9", late)
    report = shaper.sync(pods)
    assert report.count("shaped") == 2 and set(node.tc.read().devices) == {node.veth3, late}


def test_foreign_owners_and_non_veths_are_reported_not_fought():
    node = Node()
    node.tc.set_foreign(node.cali1, hook="clsact (bpf, Cilium)")
    node.tc.route("10.9.9.9", node.up)
    shaper = Shaper(node.tc, INTERNAL, {})
    report = shaper.sync([limited("a", "10.244.1.1"), limited("host", "10.9.9.9")])
    assert report.pods[("team", "a")].state == "error" and "another owner" in report.pods[("team", "a")].detail
    assert report.pods[("team", "host")].state == "conflict"
    assert node.tc.calls == []


def test_one_failing_pod_does_not_stop_the_others():
    node = Node()
    node.tc.fail("shape_download")
    shaper = Shaper(node.tc, INTERNAL, {})
    report = shaper.sync([limited("a", "10.244.1.1"), limited("b", "10.244.1.2")])
    assert sorted(p.state for p in report.pods.values()) == ["error", "shaped"]
    assert shaper.sync([limited("a", "10.244.1.1"), limited("b", "10.244.1.2")]).count("shaped") == 2


def test_interface_replaced_and_cleanup():
    node = Node()
    shaper = Shaper(node.tc, INTERNAL, {})
    pod = limited("a", "10.244.1.1")
    shaper.sync([pod])
    node.tc.remove_link(node.cali1)  # the pod's sandbox was re-created: new veth, old IFB left behind
    fresh = node.tc.add_link("cali1")
    node.tc.route("10.244.1.1", fresh)
    shaper.sync([pod])
    state = node.tc.read()
    assert set(state.devices) == {fresh} and state.devices[fresh].upload_ifb == state.ifbs[ifb_name(pod)].index
    assert shaper.remove_all() and node.tc.read().devices == {} and node.tc.read().ifbs == {}


def test_metrics_limits_bytes_drops_and_states():
    node = Node()
    shaper = Shaper(node.tc, INTERNAL, parse_defaults({"team": {"egress": "5M"}}))
    registry = CollectorRegistry()
    registry.register(ShapingCollector(shaper))
    pod = limited("a", "10.244.1.1", egress=None)  # egress from the namespace default
    shaper.sync([pod, limited("later", "10.244.9.9")])
    node.tc.add_traffic(node.cali1, 5000, drops=3)
    node.tc.add_traffic(node.tc.read().ifbs[ifb_name(pod)].index, 700)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("gpu_node_agent_pod_internet_limit_bits_per_second", namespace="team", pod="a",
                 direction="ingress") == 40e6
    assert value("gpu_node_agent_pod_internet_limit_bits_per_second", namespace="team", pod="a",
                 direction="egress") == 5e6
    assert value("gpu_node_agent_pod_internet_shaped_bytes_total", namespace="team", pod="a",
                 direction="ingress") == 5000
    assert value("gpu_node_agent_pod_internet_dropped_packets_total", namespace="team", pod="a",
                 direction="ingress") == 3
    assert value("gpu_node_agent_pod_internet_shaped_bytes_total", namespace="team", pod="a",
                 direction="egress") == 700
    assert value("gpu_node_agent_shaping_pods", state="pending") == 1
    assert value("gpu_node_agent_shaping_pods", state="shaped") == 1
    assert value("gpu_node_agent_shaping_up") == 1
    assert value("gpu_node_agent_shaping_sync_failures_total") == 0
    assert value("gpu_node_agent_shaping_invalid_annotations_total") == 0


def test_one_hostile_annotation_is_refused_for_its_pod_only():
    """Issue 27: `1e9999999` raised decimal.Overflow out of the resolver and failed every pod's sync."""
    node = Node()
    shaper = Shaper(node.tc, INTERNAL, {})
    registry = CollectorRegistry()
    registry.register(ShapingCollector(shaper))
    hostile = make_pod("team", "hostile", ["10.244.1.2"], uid="u-h",
                       annotations={EGRESS_ANNOTATION: "1e9999999", INGRESS_ANNOTATION: "1e999999"})
    started = time.process_time()
    for _ in range(2):  # the same bad values on the next sync are not counted again
        report = shaper.sync([limited("a", "10.244.1.1"), hostile])
    assert time.process_time() - started < 2  # each sync stalled the loop for 30 s of CPU
    assert report.count("shaped") == 1 and ("team", "hostile") not in report.pods
    assert sorted(p.direction for p in report.problems[("team", "hostile")][1]) == ["egress", "ingress"]
    assert registry.get_sample_value("gpu_node_agent_shaping_sync_failures_total") == 0
    assert registry.get_sample_value("gpu_node_agent_shaping_invalid_annotations_total") == 2


def test_the_pod_watch_carries_uid_and_annotations():
    # metadata as the API server sends it (kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1)
    view = PodView.from_dict({"metadata": {"namespace": "team", "name": "p", "uid": "0b1c-42",
                                           "annotations": {EGRESS_ANNOTATION: "50M"}},
                              "spec": {}, "status": {"phase": "Running", "podIPs": [{"ip": "10.244.0.5"}]}})
    (pod,) = addressed([view])
    assert pod.uid == "0b1c-42" and pod.annotation_map == {EGRESS_ANNOTATION: "50M"}
