"""The fleet view: one paginated LIST of Nodes, no other request, then the totals as text or JSON.

The LIST asks for `limit` nodes a page and follows `continue` until it is absent: a page may hold fewer nodes
than asked, or none, while more follow (the API server filters after reading a page). It never sends a
resourceVersion with `continue` (the server refuses that: 400). A continue token that expired mid-way (410, after
several minutes) restarts the list once from the beginning; a server that repeats a token or pages forever is
refused rather than followed. A node name seen twice (a server that pages badly) counts once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from agent.fleet.verdicts import VERDICTS, FleetKeys, NodeState, Summary, node_state
from agent.kube.errors import ApiGone, ApiServerError
from agent.kube.nodelist import NodeSummary
from agent.kube.port import NodeListApi

log = logging.getLogger(__name__)

PAGE_LIMIT = 500  # the API server's own default chunk size for kubectl; 7,500 nodes are 15 pages
MAX_PAGES = 4000  # two million nodes at 500 a page: a server still answering `continue` past this is refused


@dataclass(frozen=True)
class Fleet:
    """The fleet's totals and every node's state, sorted by name."""

    summary: Summary
    nodes: tuple[NodeState, ...]

    def to_json(self) -> dict[str, object]:
        """`fleet --json`: {"summary": {...}, "nodes": [...]}."""
        return {"summary": self.summary.to_json(), "nodes": [n.to_json() for n in self.nodes]}


async def list_nodes(api: NodeListApi, selector: str, limit: int = PAGE_LIMIT) -> list[NodeSummary]:
    """Every node the selector matches, page by page; a 410 on a continue token restarts the list once."""
    for attempt in (1, 2):
        found: dict[str, NodeSummary] = {}
        token = ""
        tokens: set[str] = set()
        try:
            for _ in range(MAX_PAGES):
                page = await api.list_nodes_page(selector, limit, token)
                for node in page.nodes:
                    found.setdefault(node.name, node)
                if not page.continue_token:
                    return list(found.values())
                if page.continue_token in tokens:
                    raise ApiServerError(502, "the node list repeated a continue token")
                tokens.add(page.continue_token)
                token = page.continue_token
            raise ApiServerError(502, f"the node list did not end within {MAX_PAGES} pages")
        except ApiGone:
            if attempt == 2 or not token:
                raise
            log.warning("the node list's continue token expired; listing again from the start")
    raise AssertionError("unreachable")


async def collect(selector: str, kubeconfig: str | None, timeout: float) -> list[NodeSummary]:
    """Every matching node, through the real cluster port (kubeconfig or the in-cluster service account)."""
    from prometheus_client import CollectorRegistry

    from agent.kube import connect_nodes

    api = connect_nodes(CollectorRegistry(), kubeconfig, timeout)
    try:
        return await list_nodes(api, selector)
    finally:
        await api.aclose()


def assess(nodes: list[NodeSummary], keys: FleetKeys, now: float, repeat: int) -> Fleet:
    """Each node's state and the totals."""
    summary = Summary()
    states = sorted((node_state(node, keys, now, repeat) for node in nodes), key=lambda s: s.name)
    for state in states:
        summary.add(state)
    return Fleet(summary, tuple(states))


def to_text(fleet: Fleet, repeat: int) -> str:
    """The human summary: buckets, cordons, latches, GPUs, repeat offenders."""
    s = fleet.summary
    lines = [f"nodes: {s.nodes}"]
    lines += [f"  {verdict:<9}{s.verdicts[verdict]:>8}" for verdict in VERDICTS]
    lines.append(f"cordoned by the agent: {s.cordoned}")
    lines.append(f"latched (needs a human): {s.latched}")
    ratio = f" ({100.0 * s.gpus_healthy / s.gpus_expected:.2f}%)" if s.gpus_expected else ""
    lines.append(f"GPUs healthy / expected: {s.gpus_healthy} / {s.gpus_expected}{ratio}")
    lines.append(f"repeat offenders (>= {repeat} incidents in their window): {len(s.repeat_offenders)}")
    by_name = {n.name: n for n in fleet.nodes}
    for name in sorted(s.repeat_offenders):
        node = by_name[name]
        cause = node.incidents.last_cause if node.incidents is not None else ""
        lines.append(f"  {name}  {node.recent_incidents} incidents, last {cause or '-'}, now {node.verdict}")
    return "\n".join(lines)
