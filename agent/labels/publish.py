"""Where node labels go: NFD's NodeFeature `gpu-node-agent-<node>`, or the Node's own labels.

Both targets first read what is published (`read`), then write only when the wanted set differs, in one request
(`write`); neither ever deletes on exit. The NodeFeature lives in the agent's namespace with the label
`nfd.node.kubernetes.io/node-name: <node>` and is owned by the agent's DaemonSet (controller) and Pod, as GFD's
and nfd-worker's are (kubernetes-sigs/node-feature-discovery#1752, #1817): a restart or rollout keeps it,
deleting the DaemonSet removes it. Custom resources take no strategic merge and no unconditional update, so it is
replaced with the resourceVersion read (409: read again). On the Node, only keys the agent owns are written: the
annotation `gpunodeagent.io/labels` lists them, so a key the agent stops owning is removed and a label someone
else wrote (present, not listed) is never touched; the patch carries the Node's resourceVersion.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agent.config.fields import PROJECT_DOMAIN
from agent.kube.errors import ApiConflict
from agent.kube.model import OwnerRef
from agent.kube.port import NodeApi, NodeFeatureApi

log = logging.getLogger(__name__)

NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"
OWNED_PREFIXES = ("nvidia.com/", f"{PROJECT_DOMAIN}/")  # the only keys the annotation can make the agent's
MAX_OWNED = 512  # far above the agent's ~80 keys; an annotation listing more is not the agent's
OWNED_ANNOTATION = f"{PROJECT_DOMAIN}/labels"
API_VERSION = "nfd.k8s-sigs.io/v1alpha1"


def feature_name(node: str) -> str:
    """The agent's NodeFeature for `node`."""
    return f"gpu-node-agent-{node}"


class Target(Protocol):
    """A place labels are published."""

    mode: str

    async def read(self) -> dict[str, str]:
        """The labels the agent has published there (empty when nothing is)."""

    async def write(self, labels: Mapping[str, str]) -> bool:
        """Publish exactly `labels` (the agent's keys); False when nothing differed (no request was made).
        ApiConflict when someone changed the object since it was read (it is read again next time)."""


class NodeFeatureTarget:
    """The agent's NodeFeature in its namespace."""

    mode = "nodefeature"

    def __init__(self, api: NodeFeatureApi, namespace: str, owners: Sequence[OwnerRef] = ()) -> None:
        self.api, self.namespace, self.owners = api, namespace, tuple(owners)
        self.name = feature_name(api.node_name)
        self._current: dict[str, Any] | None = None
        self._read = False

    async def read(self) -> dict[str, str]:
        """GET the object (kept, with its resourceVersion, for the next replace)."""
        self._current = await self.api.get_node_feature(self.namespace, self.name)
        self._read = True
        return dict(((self._current or {}).get("spec") or {}).get("labels") or {})

    def _wanted(self, labels: Mapping[str, str]) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace,
                                "labels": {NODE_NAME_LABEL: self.api.node_name}}
        if self.owners:
            meta["ownerReferences"] = [o.to_dict() for o in self.owners]
        return {"apiVersion": API_VERSION, "kind": "NodeFeature", "metadata": meta,
                "spec": {"labels": dict(labels)}}

    def _same(self, labels: Mapping[str, str]) -> bool:
        current = self._current or {}
        meta = current.get("metadata") or {}
        owned_by = {str(o.get("uid")) for o in meta.get("ownerReferences") or () if isinstance(o, dict)}
        return (((current.get("spec") or {}).get("labels") or {}) == dict(labels)
                and (meta.get("labels") or {}).get(NODE_NAME_LABEL) == self.api.node_name
                and all(o.uid in owned_by for o in self.owners))

    async def write(self, labels: Mapping[str, str]) -> bool:
        """Create the object, or replace it when its labels, node name or owners differ."""
        if not self._read:
            await self.read()
        if self._current is not None and self._same(labels):
            return False
        body = self._wanted(labels)
        try:
            if self._current is None:
                self._current = await self.api.create_node_feature(self.namespace, body)
            else:
                current_meta = self._current.get("metadata") or {}
                meta = body["metadata"]
                meta["resourceVersion"] = current_meta.get("resourceVersion")
                # keep other owners (an old Pod's reference goes with that Pod), and any labels others added
                meta["labels"] = {**(current_meta.get("labels") or {}), **meta["labels"]}
                mine = {o.uid for o in self.owners}
                kept = [o for o in current_meta.get("ownerReferences") or () if isinstance(o, dict)
                        and o.get("uid") not in mine and o.get("kind") != "Pod"]
                if self.owners or kept:
                    meta["ownerReferences"] = [o.to_dict() for o in self.owners] + kept
                self._current = await self.api.replace_node_feature(self.namespace, body)
        except ApiConflict:
            self._read = False  # changed (or created) by someone else since: read it again
            raise
        return True


class NodeTarget:
    """The Node's own labels, keys the agent owns only."""

    mode = "node"

    def __init__(self, api: NodeApi) -> None:
        self.api = api
        self._owned: set[str] = set()
        self._labels: dict[str, str] = {}
        self._version = ""
        self._read = False

    async def read(self) -> dict[str, str]:
        """GET the Node: the keys its annotation lists as the agent's, with their values."""
        node = await self.api.get_node()
        listed = node.annotations.get(OWNED_ANNOTATION, "")[:MAX_OWNED * 128].split(",")
        # an edited annotation must not make the agent remove labels it never wrote (kubernetes.io/hostname)
        self._owned = {key for key in listed[:MAX_OWNED] if key.startswith(OWNED_PREFIXES)}
        self._labels = dict(node.labels)
        self._version = node.resource_version
        self._read = True
        return {k: v for k, v in self._labels.items() if k in self._owned}

    def foreign(self, key: str) -> bool:
        """A label on the Node the agent did not write (as of the last read)."""
        return key in self._labels and key not in self._owned

    async def write(self, labels: Mapping[str, str]) -> bool:
        """One merge patch of the changed keys, the removed ones and the annotation, guarded by resourceVersion."""
        if not self._read:
            await self.read()
        wanted = {k: v for k, v in labels.items() if not self.foreign(k)}
        for key in sorted(set(labels) - set(wanted)):
            log.warning("node label %s is already on the Node and not the agent's: left alone", key)
        changed: dict[str, str | None] = {k: v for k, v in wanted.items() if self._labels.get(k) != v}
        changed.update({k: None for k in self._owned - wanted.keys() if k in self._labels})
        listing = ",".join(sorted(wanted))
        if not changed and listing == ",".join(sorted(self._owned)):
            return False
        patch = {"metadata": {"labels": changed, "annotations": {OWNED_ANNOTATION: listing}}}
        try:
            node = await self.api.patch_node(patch, self._version or None)
        except ApiConflict:
            self._read = False
            raise
        self._labels, self._version = dict(node.labels), node.resource_version
        self._owned = set(wanted)
        return True
