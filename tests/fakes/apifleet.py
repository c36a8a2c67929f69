"""An API double holding a whole fleet of Nodes, for `gpu-node-agent fleet`: the cluster-wide Node LIST with the
paging and selector semantics of the real API server, and nothing else (every other request is recorded and 404).

- `limit` + `continue`: pages come from one snapshot taken at the first page. As in the real server's storage
  layer, a page reads the next `limit` stored objects and then applies the label selector, so a page can be short
  or empty while a `continue` token still follows (`page_sizes` also forces given page sizes, selector or not).
- `resourceVersion` other than "" or "0" together with `continue`: 400 "specifying resource version is not allowed
  when using continue"; `expire_tokens()` makes every issued token answer 410 Expired.
- `labelSelector`: comma-separated `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`; other syntax
  is 400, as the server answers.

Each node is JSON-encoded once when it is stored, so serving 7,500 realistic nodes costs the test process little.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Any

from tests.fakes.clock import FakeClock
from tests.fakes.httpdouble import Answer, HttpDouble, Request, status_body

_TERM = re.compile(r"\s*(!?)([A-Za-z0-9._/-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*")


class LabelSelectorError(ValueError):
    """A label selector the API server would refuse (400)."""


def parse_label_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(key, operator, values) per term; operators: =, !=, in, notin, exists, !exists."""
    terms: list[tuple[str, str, tuple[str, ...]]] = []
    for part in re.split(r",(?![^()]*\))", text) if text.strip() else []:
        m = _TERM.fullmatch(part)
        if m is None:
            raise LabelSelectorError(f"unable to parse requirement: {part!r}")
        bang, key, op, value, set_op, values = m.groups()
        if bang and (op or set_op):
            raise LabelSelectorError(f"unable to parse requirement: {part!r}")
        if op:
            terms.append((key, "!=" if op == "!=" else "=", (value,)))
        elif set_op:
            terms.append((key, set_op, tuple(v.strip() for v in values.split(",") if v.strip())))
        else:
            terms.append((key, "!exists" if bang else "exists", ()))
    return terms


def _holds(value: str | None, op: str, values: tuple[str, ...]) -> bool:
    if op in ("=", "in"):
        return value in values
    if op in ("!=", "notin"):
        return value not in values
    return (value is not None) == (op == "exists")


def _matches(labels: dict[str, str], terms: list[tuple[str, str, tuple[str, ...]]]) -> bool:
    return all(_holds(labels.get(key), op, values) for key, op, values in terms)


class FleetApiDouble(HttpDouble):
    """Nodes over HTTP: GET /api/v1/nodes only."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self._nodes: dict[str, tuple[dict[str, str], bytes]] = {}  # name -> (labels, encoded node)
        self._snapshots: dict[int, list[tuple[dict[str, str], bytes]]] = {}
        self._generation = 0
        self.rv = 1000
        self.page_sizes: list[int] = []  # forced sizes (>= 1) of the next pages' reads before the selector
        self.page_items: list[int] = []  # how many nodes each answered page held

    def put_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """Store (or replace) nodes, encoded once."""
        for node in nodes:
            self.rv += 1
            node["metadata"]["resourceVersion"] = str(self.rv)
            self._nodes[node["metadata"]["name"]] = (dict(node["metadata"].get("labels") or {}),
                                                      json.dumps(node, separators=(",", ":")).encode())

    def expire_tokens(self) -> None:
        """Every continue token issued so far answers 410 (etcd compacted past its snapshot)."""
        self._snapshots.clear()

    def node_lists(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path == "/api/v1/nodes"]

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.method not in ("GET", "HEAD", "OPTIONS")]

    async def _answer(self, r: Request) -> Answer:
        fault = await self._fault(r)
        if fault is not None:
            return fault
        if r.path == "/api/v1/nodes" and r.method == "GET":
            return self._list(r.query)
        return 404, status_body(404, f"{r.method} {r.path} is not served by the double", "NotFound"), {}

    def _list(self, query: dict[str, str]) -> Answer:
        token, version = query.get("continue", ""), query.get("resourceVersion", "")
        if token and version not in ("", "0"):
            return 400, status_body(400, "specifying resource version is not allowed when using continue",
                                    "BadRequest"), {}
        try:
            terms = parse_label_selector(query.get("labelSelector", ""))
            limit = int(query.get("limit", "0") or "0")
        except (LabelSelectorError, ValueError) as exc:
            return 400, status_body(400, f"unable to parse requirement: {exc}", "BadRequest"), {}
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                snapshot, offset = self._snapshots[state["snapshot"]], int(state["offset"])
                generation = state["snapshot"]
            except KeyError:
                return 410, status_body(410, "The provided continue parameter is too old to display a consistent "
                                             "list result. You can start a new list without the continue "
                                             "parameter.", "Expired"), {}
            except ValueError:
                return 400, status_body(400, "continue key is not valid", "BadRequest"), {}
        else:
            self._generation += 1
            generation, offset = self._generation, 0
            snapshot = [self._nodes[name] for name in sorted(self._nodes)]
            self._snapshots[generation] = snapshot
        size = max(1, self.page_sizes.pop(0)) if self.page_sizes else (limit or len(snapshot))
        window = snapshot[offset:offset + size]
        items = [encoded for labels, encoded in window if _matches(labels, terms)]
        end = offset + len(window)
        self.page_items.append(len(items))
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if end < len(snapshot):
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"snapshot": generation, "offset": end}).encode()).decode()
            meta["remainingItemCount"] = len(snapshot) - end
        head = json.dumps({"kind": "NodeList", "apiVersion": "v1", "metadata": meta}, separators=(",", ":"))
        body = head[:-1].encode() + b',"items":[' + b",".join(items) + b"]}"
        return 200, body, {}

    async def _respond(self, writer: asyncio.StreamWriter, status: int, body: Any,
                       extra: dict[str, str] | None = None) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}"] + [f"{k}: {v}" for k, v in (extra or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()

    async def _watch(self, r: Request, writer: asyncio.StreamWriter) -> None:
        await self._respond(writer, 404, status_body(404, "watch not served", "NotFound"))
