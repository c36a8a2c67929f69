"""A small stand-in for the scheduler's DRA allocator: exact-count requests, DeviceClass selectors, matchAttribute.

It follows the structured-parameters rules a node agent's slices must satisfy (k8s.io/dynamic-resource-allocation
structured allocator; `/work/shared/reference/dra.md` sections 5, 6 and 10):
- only complete pools count: the slices at a pool's highest `generation`, as many as `resourceSliceCount`;
- a device tainted `NoSchedule` or `NoExecute` is skipped unless the request tolerates the taint; `None` and
  unknown effects are ignored;
- a device is allocated at most once (across the claims given as already allocated, and within a claim);
- `matchAttribute`: every device of the listed requests (all requests when the list is empty) carries the
  attribute, with the same value; a device without it never matches;
- DeviceClass selectors: the CEL forms our manifests use, `device.driver == "D"` and
  `device.attributes["DOMAIN"].NAME == "VALUE"`, joined with `&&`; anything else is refused (not guessed).
The search is a plain backtracking over requests in order, enough for a node's pool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DRIVER = re.compile(r'^device\.driver\s*==\s*"([^"]+)"$')
_ATTRIBUTE = re.compile(r'^device\.attributes\["([^"]+)"\]\.([A-Za-z_][A-Za-z0-9_]*)\s*==\s*"([^"]*)"$')


class UnsupportedSelector(ValueError):
    """A CEL expression beyond the two forms this stand-in evaluates."""


@dataclass(frozen=True)
class Candidate:
    """One published device."""

    driver: str
    pool: str
    name: str
    attributes: Mapping[str, Mapping[str, Any]]
    taints: tuple[Mapping[str, Any], ...] = ()

    def value(self, qualified: str) -> Any:
        attribute = self.attributes.get(qualified)
        if attribute is None:
            return None
        return next(iter(attribute.values()))


def complete_pools(slices: Iterable[Mapping[str, Any]]) -> list[Candidate]:
    """Devices of every complete pool, at its highest generation."""
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in slices:
        spec = s["spec"]
        pools.setdefault((spec["driver"], spec["pool"]["name"]), []).append(s)
    found = []
    for (driver, pool), members in pools.items():
        top = max(m["spec"]["pool"]["generation"] for m in members)
        current = [m for m in members if m["spec"]["pool"]["generation"] == top]
        if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
            continue  # incomplete: a publish is under way
        for member in current:
            found.extend(Candidate(driver, pool, d["name"], d.get("attributes") or {}, tuple(d.get("taints") or ()))
                         for d in member["spec"].get("devices") or [])
    return found


def selects(expression: str, device: Candidate) -> bool:
    """Evaluate a DeviceClass or request selector of the supported forms."""
    result = True
    for term in (t.strip() for t in expression.split("&&")):
        if m := _DRIVER.match(term):
            result = result and device.driver == m.group(1)
        elif m := _ATTRIBUTE.match(term):
            qualified = f"{m.group(1)}/{m.group(2)}" if "/" not in m.group(2) else m.group(2)
            result = result and str(device.value(qualified)) == m.group(3)
        else:
            raise UnsupportedSelector(term)
    return result


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for toleration in tolerations:
        if toleration.get("key") not in (None, "", taint.get("key")):
            continue
        if toleration.get("effect") not in (None, "", taint.get("effect")):
            continue
        if toleration.get("operator", "Equal") == "Exists" or toleration.get("value") == taint.get("value"):
            return True
    return False


def allocate(claim: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]], slices: Iterable[Mapping[str, Any]],
             in_use: Iterable[tuple[str, str, str]] = ()) -> dict[str, Any] | None:
    """`status.allocation` for the claim's spec, or None when no assignment satisfies it."""
    spec = claim["spec"]["devices"]
    requests = spec.get("requests") or []
    busy = set(in_use)
    pool = [c for c in complete_pools(slices) if (c.driver, c.pool, c.name) not in busy]
    options: list[tuple[str, int, list[Candidate]]] = []
    for request in requests:
        exact = request["exactly"]
        device_class = classes[exact["deviceClassName"]]
        selectors = [s["cel"]["expression"] for s in device_class["spec"].get("selectors") or []]
        selectors += [s["cel"]["expression"] for s in exact.get("selectors") or []]
        tolerations = exact.get("tolerations") or []
        fits = [c for c in pool if all(selects(e, c) for e in selectors)
                and all(_tolerated(t, tolerations) for t in c.taints)]
        options.append((request["name"], int(exact.get("count", 1)), fits))
    constraints = [(c.get("requests") or [r["name"] for r in requests], c["matchAttribute"])
                   for c in spec.get("constraints") or [] if "matchAttribute" in c]
    chosen: list[tuple[str, Candidate]] = []

    def consistent() -> bool:
        for names, attribute in constraints:
            values = [d.value(attribute) for r, d in chosen if r in names]
            if any(v is None for v in values) or len(set(values)) > 1:
                return False
        return True

    def search(index: int, left: int) -> bool:
        if index == len(options):
            return True
        name, _, fits = options[index]
        if left == 0:
            return search(index + 1, options[index + 1][1] if index + 1 < len(options) else 0)
        for device in fits:
            if any(device is d for _, d in chosen):
                continue
            chosen.append((name, device))
            if consistent() and search(index, left - 1):
                return True
            chosen.pop()
        return False

    if not options or not search(0, options[0][1]):
        return None
    return {"devices": {"results": [{"request": r, "driver": d.driver, "pool": d.pool, "device": d.name}
                                    for r, d in chosen]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": sorted({d.pool for _, d in chosen})}]}]}}
