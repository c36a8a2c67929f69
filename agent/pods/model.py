"""This node's pods as the network subsystems see them: namespace, name, validated addresses, UID, annotations.

A `Pod` here is a pod with its own network addresses on this node: the pod sources (`agent.pods.source`) never
publish a host-network pod (its traffic is the node's), a finished one (its addresses are back in the pool) or
one without an address yet. Addresses are validated and normalised here (`ipaddress`), so nothing downstream
ever formats an unchecked string into a command. Names and namespaces are kept verbatim: they only ever become
Prometheus label values. What a consumer does with a pod (count it, shape it) is the consumer's own filter.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class PodListError(ValueError):
    """A pod list that cannot be used; the message says where it is wrong."""


@dataclass(frozen=True)
class Pod:
    """One pod on this node: namespace, name, its IPs (normalised, IPv4 and/or IPv6), and optionally its UID and
    annotations (sorted pairs, so pods stay hashable; shaping reads its limits from them)."""

    namespace: str
    name: str
    ips: tuple[str, ...]
    uid: str = ""
    annotations: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        """(namespace, name)."""
        return self.namespace, self.name

    @property
    def annotation_map(self) -> dict[str, str]:
        """The annotations as a mapping."""
        return dict(self.annotations)


def make_pod(namespace: str, name: str, ips: Iterable[str], uid: str = "",
             annotations: Mapping[str, str] | None = None) -> Pod:
    """A Pod with validated, normalised, de-duplicated IPs; PodListError on a bad address."""
    out: list[str] = []
    for ip in ips:
        try:
            text = ipaddress.ip_address(str(ip).strip()).compressed
        except ValueError:
            raise PodListError(f"pod {namespace}/{name}: {ip!r} is not an IP address") from None
        if text not in out:
            out.append(text)
    pairs = tuple(sorted((str(k), str(v)) for k, v in (annotations or {}).items()))
    return Pod(str(namespace), str(name), tuple(out), str(uid), pairs)


def parse_pods(data: Any) -> list[Pod]:
    """`{"pods":[{"namespace":..,"name":..,"ips":[..],"uid":..,"annotations":{..}}]}` -> pods (uid and annotations
    optional); PodListError on anything malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("pods"), list):
        raise PodListError('expected an object with a "pods" list')
    pods: list[Pod] = []
    seen: set[tuple[str, str]] = set()
    for index, entry in enumerate(data["pods"]):
        if not isinstance(entry, dict):
            raise PodListError(f"pods[{index}]: expected an object")
        namespace, name, ips = entry.get("namespace"), entry.get("name"), entry.get("ips", [])
        if not isinstance(namespace, str) or not namespace or not isinstance(name, str) or not name:
            raise PodListError(f"pods[{index}]: namespace and name must be non-empty strings")
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise PodListError(f"pods[{index}] ({namespace}/{name}): ips must be a list of strings")
        uid, annotations = entry.get("uid", ""), entry.get("annotations", {})
        if not isinstance(uid, str):
            raise PodListError(f"pods[{index}] ({namespace}/{name}): uid must be a string")
        if not isinstance(annotations, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()):
            raise PodListError(f"pods[{index}] ({namespace}/{name}): annotations must map strings to strings")
        if (namespace, name) in seen:
            raise PodListError(f"pods[{index}]: {namespace}/{name} is listed twice")
        seen.add((namespace, name))
        pods.append(make_pod(namespace, name, ips, uid, annotations))
    return pods
