"""The cluster-wide Node LIST through the real port, read-only, for the operator's fleet view
(`gpu-node-agent fleet`): its own client, since it serves no node.

A page is read with a size bound (`agent.kube.nodelist.MAX_PAGE_BYTES`) and decoded in a worker thread.
"""

from __future__ import annotations

import asyncio

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node

from agent.kube.calls import async_client, read_list
from agent.kube.metrics import ApiRequestCounter
from agent.kube.nodelist import MAX_PAGE_BYTES, NodePage, decode_node_page


class LightkubeNodes:
    """`port.NodeListApi`: pages of the cluster-wide Node LIST, read-only (`gpu-node-agent fleet`)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list_nodes_page(self, label_selector: str, limit: int, continue_token: str) -> NodePage:
        """One LIST page; never a resourceVersion (with `continue` the server refuses one: 400)."""
        params = {"limit": str(limit), "labelSelector": label_selector or None, "continue": continue_token or None}
        body = await read_list(self._client, Node, params=params, limit=MAX_PAGE_BYTES, what="node list page")
        return await asyncio.to_thread(decode_node_page, body)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.close()


def connect_nodes(counter: ApiRequestCounter, kubeconfig: str | None = None, timeout: float = 10.0) -> LightkubeNodes:
    """A `LightkubeNodes` from a kubeconfig file, or the in-cluster service account."""
    return LightkubeNodes(async_client(counter, kubeconfig, timeout))
