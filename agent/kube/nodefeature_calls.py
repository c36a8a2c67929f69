"""NFD's NodeFeature objects through the real port (node labels publish on one when NFD is installed); a base of
`agent.kube.cluster.LightkubeCluster`.

The resource is declared generically (lightkube has no model for NFD's CRD); whether the cluster serves it is read
off the group version's discovery document, which every authenticated identity may read.
"""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from agent.kube import errors
from agent.kube.calls import Calls
from agent.kube.names import url_segment

NFD_GROUP, NFD_VERSION = "nfd.k8s-sigs.io", "v1alpha1"
NodeFeature = create_namespaced_resource(NFD_GROUP, NFD_VERSION, "NodeFeature", "nodefeatures")


class NodeFeatureCalls(Calls):
    """`port.NodeFeatureApi` on lightkube."""

    async def node_features_served(self) -> bool:
        """GET the group version's discovery document (readable by every authenticated identity) and look for
        `nodefeatures`; 404 means NFD's CRD is not installed."""
        async def call() -> bool:
            response = await self._client._client._client.get(f"/apis/{NFD_GROUP}/{NFD_VERSION}")
            if response.status_code == 404:
                return False
            response.raise_for_status()
            resources = (response.json() or {}).get("resources") or []
            return any(isinstance(r, dict) and r.get("name") == "nodefeatures" for r in resources)
        return await self._do(call)

    async def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """GET a NodeFeature; None for 404."""
        try:
            found = await self._do(lambda: self._client.get(NodeFeature, url_segment(name),
                                                            namespace=url_segment(namespace, namespace=True)))
        except errors.ApiNotFound:
            return None
        return dict(found.to_dict())

    async def create_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a NodeFeature."""
        path_ns = url_segment(namespace, namespace=True)
        created = await self._do(lambda: self._client.create(NodeFeature.from_dict(body), namespace=path_ns))  # type: ignore[call-overload]
        return dict(created.to_dict())

    async def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a NodeFeature (its resourceVersion is the precondition)."""
        name = str((body.get("metadata") or {}).get("name") or "")
        path_ns = url_segment(namespace, namespace=True)
        written = await self._do(lambda: self._client.replace(NodeFeature.from_dict(body), url_segment(name),
                                                              namespace=path_ns))
        return dict(written.to_dict())
