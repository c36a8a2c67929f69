"""The Events and Leases endpoints of the API double (a mixin), and RFC 7386 merge patch."""

from __future__ import annotations

import copy
from typing import Any

from tests.fakes.httpdouble import Answer, Request, status_body


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class EventsAndLeases:
    """core/v1 Events with generateName; Leases with create-409 and replace-409. Needs `rv` and `_bump()`."""

    rv: int
    events: dict[str, dict[str, Any]]
    leases: dict[tuple[str, str], dict[str, Any]]

    def _bump(self) -> str:
        raise NotImplementedError

    def _event(self, r: Request, namespace: str, name: str | None) -> Answer:
        if r.method == "POST" and name is None:
            event = dict(r.body)
            meta = dict(event.get("metadata") or {})
            meta["name"] = meta.get("name") or f"{meta.get('generateName', 'event.')}{len(self.events):05x}"
            meta["namespace"] = namespace
            meta["resourceVersion"] = self._bump()
            event["metadata"] = meta
            self.events[meta["name"]] = event
            return 201, event, {}
        if r.method == "PATCH" and name is not None:
            if name not in self.events:
                return 404, status_body(404, f'events "{name}" not found', "NotFound"), {}
            self.events[name] = merge_patch(self.events[name], r.body)
            return 200, self.events[name], {}
        return 404, status_body(404, "no such event route", "NotFound"), {}

    def _lease(self, r: Request, namespace: str, name: str | None) -> Answer:
        if r.method == "GET" and name is None:
            wanted = dict(part.split("=", 1) for part in r.query.get("labelSelector", "").split(",") if part)
            items = [le for (ns, _), le in self.leases.items() if ns == namespace
                     and all((le["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
            return 200, {"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                         "metadata": {"resourceVersion": str(self.rv)}, "items": items}, {}
        if r.method == "POST" and name is None:
            key = (namespace, r.body["metadata"]["name"])
            if key in self.leases:
                return 409, status_body(409, f'leases "{key[1]}" already exists', "AlreadyExists"), {}
            lease = copy.deepcopy(r.body)
            lease["metadata"]["resourceVersion"] = self._bump()
            self.leases[key] = lease
            return 201, lease, {}
        if r.method == "PUT" and name is not None:
            current = self.leases.get((namespace, name))
            if current is None:
                return 404, status_body(404, f'leases "{name}" not found', "NotFound"), {}
            if r.body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return 409, status_body(409, "the object has been modified", "Conflict"), {}
            lease = copy.deepcopy(r.body)
            lease["metadata"]["resourceVersion"] = self._bump()
            self.leases[(namespace, name)] = lease
            return 200, lease, {}
        return 404, status_body(404, "no such lease route", "NotFound"), {}
