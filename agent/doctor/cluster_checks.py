"""Checks that talk to a service: the Kubernetes API server (reachable, own Node readable, RBAC per enabled
subsystem by SelfSubjectAccessReview) and dcgm-exporter (reachable, this node's GPUs on its page, scrape time).

Read-only: a GET of the own Node, access reviews (which change nothing), one scrape.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry

from agent.doctor.context import Context
from agent.doctor.report import Check, fail, ok, skip, warn
from agent.health.dcgm_scrape import MalformedScrapeError, keep_line, parse_scrape
from agent.host.dcgm_exporter import DcgmScrapeError, HttpDcgmExporter
from agent.kube.access import ClusterPort
from agent.kube.errors import ApiError, ClusterConfigError
from agent.kube.port import AccessApi, NodeFeatureApi

# (API group, resource, subresource, verb) each subsystem needs; deploy/rbac.yaml grants them
Need = tuple[str, str, str, str]
_NODE: tuple[Need, ...] = (("", "nodes", "", "get"), ("", "nodes", "", "watch"))
_PODS: tuple[Need, ...] = (("", "pods", "", "list"), ("", "pods", "", "watch"))
_EVENTS: tuple[Need, ...] = (("", "events", "", "create"), ("", "events", "", "patch"))
NEEDS: dict[str, tuple[Need, ...]] = {
    "remediation": (*_NODE, ("", "nodes", "", "patch"), ("", "nodes", "status", "patch"), *_PODS,
                    ("", "pods", "eviction", "create"), *_EVENTS,
                    ("coordination.k8s.io", "leases", "", "list"), ("coordination.k8s.io", "leases", "", "create"),
                    ("coordination.k8s.io", "leases", "", "update")),
    "ownership": (*_PODS, *_EVENTS),
    "netacct": _PODS,
    "shaping": (*_PODS, ("", "events", "", "create")),
    "dra": (("", "nodes", "", "get"), ("resource.k8s.io", "resourceslices", "", "list"),
            ("resource.k8s.io", "resourceslices", "", "create"), ("resource.k8s.io", "resourceslices", "", "update"),
            ("resource.k8s.io", "resourceslices", "", "delete"), ("resource.k8s.io", "resourceclaims", "", "get")),
}
_LEASES = "coordination.k8s.io"


def _enabled(ctx: Context) -> list[str]:
    cfg = ctx.cfg
    on = {"remediation": cfg.remediation.enabled, "ownership": bool(cfg.pod_resources.socket),
          "netacct": cfg.netacct.enabled and not cfg.netacct.pods_file, "shaping": cfg.shaping.enabled,
          "dra": cfg.dra.enabled}
    return [name for name, enabled in on.items() if enabled]


def _name(need: Need) -> str:
    group, resource, sub, verb = need
    return f"{verb} {resource}{'/' + sub if sub else ''}{'.' + group if group else ''}"


async def api(ctx: Context, *, has_credentials: bool) -> list[Check]:
    """Reachable, the own Node readable, and each verb of each enabled subsystem allowed."""
    port = ClusterPort(ctx.cfg, CollectorRegistry())
    if port.in_memory:
        return [skip("api", "no credentials: a simulated node uses the in-memory cluster")]
    if not (has_credentials or port.in_cluster):
        return [skip("api", "no credentials (no --kubeconfig, no service-account token): remediation, pod specs "
                            "and Events are off")]
    try:
        cluster = port.get()
    except ClusterConfigError as exc:
        return [fail("api", str(exc), "give --kubeconfig or run in a pod with a service account, and set NODE_NAME "
                                      "from the downward API (spec.nodeName)")]
    try:
        started = time.monotonic()
        try:
            node = await cluster.get_node()
        except ApiError as exc:
            return [fail("api", f"GET node {port.node_name}: {exc}",
                         "check the API server address and credentials, that --node-name is this node's name, and "
                         "that RBAC grants get nodes (deploy/rbac.yaml)")]
        took = (time.monotonic() - started) * 1000
        checks = [ok("api", f"{port.describe()}: node {node.name} read in {took:.0f} ms")]
        checks.append(await _rbac(ctx, cluster, _enabled(ctx)))
        checks.append(await node_labels(ctx, cluster))
        return checks
    finally:
        await port.aclose()


async def _rbac(ctx: Context, cluster: AccessApi, subsystems: Sequence[str]) -> Check:
    if not subsystems:
        return skip("api.rbac", "no enabled subsystem uses the API")
    denied: list[str] = []
    asked = 0
    lease_ns = ctx.cfg.remediation.lease_namespace()
    for subsystem in subsystems:
        for need in NEEDS[subsystem]:
            group, resource, sub, verb = need
            namespace = lease_ns if group == _LEASES else ""
            try:
                allowed, _ = await cluster.review_access(verb, resource, group=group, subresource=sub,
                                                         namespace=namespace)
            except ApiError as exc:
                return warn("api.rbac", f"SelfSubjectAccessReview failed: {exc}",
                            "the API server must serve authorization.k8s.io/v1")
            asked += 1
            if not allowed:
                denied.append(f"{subsystem}: {_name(need)}")
    if denied:
        return fail("api.rbac", f"denied: {'; '.join(denied)}",
                    "apply deploy/rbac.yaml (and deploy/dra/rbac.yaml for --dra) to the agent's service account")
    return ok("api.rbac", f"{asked} verbs allowed for {', '.join(subsystems)}")


class _LabelApi(AccessApi, NodeFeatureApi, Protocol):
    """What the node-labels check asks: access reviews and whether NodeFeatures are served."""


_NFD = "nfd.k8s-sigs.io"


async def node_labels(ctx: Context, cluster: _LabelApi) -> Check:
    """The node-labels mode in force (auto: NodeFeature where served, else the Node) and its permissions; GFD's
    namespaces the agent cannot look into (then only the Node's GFD timestamp label tells GFD is there)."""
    lc, namespace = ctx.cfg.node_labels, ctx.cfg.remediation.pod_namespace
    if lc.mode == "off":
        return skip("api.node-labels", "off (--node-labels off)")
    try:
        served = await cluster.node_features_served()
        if lc.mode == "nodefeature" and not served:
            return fail("api.node-labels", "--node-labels nodefeature, but the API server does not serve NFD's "
                                           "NodeFeature (nfd.k8s-sigs.io/v1alpha1)",
                        "install node-feature-discovery, or use --node-labels auto (the Node when NFD is absent)")
        on_node = lc.mode == "node" or not served
        if not on_node and not namespace:
            return fail("api.node-labels", "a NodeFeature lives in the agent's namespace, and none is known",
                        "set POD_NAMESPACE from the downward API (metadata.namespace), or --pod-namespace")
        wanted = [("", "nodes", "get", ""), ("", "nodes", "patch", "")] if on_node else \
            [(_NFD, "nodefeatures", verb, namespace) for verb in ("get", "create", "update")]
        denied = [f"{verb} {resource}{'.' + group if group else ''}{' in ' + ns if ns else ''}"
                  for group, resource, verb, ns in wanted
                  if not (await cluster.review_access(verb, resource, group=group, namespace=ns))[0]]
        hidden = [ns for ns in lc.gfd_namespaces if lc.gfd == "auto" and not (
            await cluster.review_access("get", "nodefeatures", group=_NFD, namespace=ns))[0]]
    except ApiError as exc:
        return warn("api.node-labels", f"cannot check: {exc}", "the API server must serve authorization.k8s.io/v1")
    where = "the Node (patch nodes)" if on_node else f"the NodeFeature gpu-node-agent-<node> in {namespace}"
    if denied:
        return fail("api.node-labels", f"labels go to {where}; denied: {'; '.join(denied)}",
                    "apply deploy/rbac.yaml (the Role gpu-node-agent-node-labels) to the agent's service account")
    if hidden:
        return warn("api.node-labels", f"labels go to {where}; GPU Feature Discovery's NodeFeature cannot be read "
                                       f"in {', '.join(hidden)} (only GFD's label on the Node shows it there)",
                    "apply deploy/gfd-read/ in each namespace of nodeLabels.gfdNamespaces, or remove the namespace")
    return ok("api.node-labels", f"labels go to {where}; {len(wanted)} verbs allowed")


async def dcgm_exporter(ctx: Context) -> Check:
    """One scrape: reachable, this node's GPUs on the page, how long it took."""
    url = ctx.cfg.health.dcgm_exporter_url
    if not url:
        return skip("dcgm-exporter", "not configured (--dcgm-exporter-url)")
    client = HttpDcgmExporter(url, min(ctx.cfg.health.dcgm_scrape_timeout_seconds, 4.0), keep=keep_line)
    started = time.monotonic()
    try:
        text = await client.fetch()
        scrape = parse_scrape(text)
    except (DcgmScrapeError, MalformedScrapeError) as exc:
        return fail("dcgm-exporter", f"{url}: {exc}", "check the exporter's pod and service on this node, and the "
                                                        "URL (hostNetwork: http://localhost:9400/metrics)")
    finally:
        await client.aclose()
    took = (time.monotonic() - started) * 1000
    ours = set(ctx.hardware.nvml.gpu_uuids().values())
    seen = {s.uuid for s in scrape.samples}
    missing = sorted(ours - seen)
    detail = f"{url} scraped in {took:.0f} ms: {len(seen)} GPUs, {len(scrape.metrics)} metric families"
    if missing:
        return fail("dcgm-exporter", f"{detail}; this node's GPUs not on the page: {', '.join(missing)}",
                    "the URL reaches another node's exporter, or the exporter lost these GPUs (restart it)")
    return ok("dcgm-exporter", detail)
