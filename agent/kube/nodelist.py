"""One page of a cluster-wide Node LIST, decoded off the event loop into only what a fleet view reads.

`gpu-node-agent fleet` pages through every Node (`limit` + `continue`). A real Node is 5-30 kB of JSON (images,
managedFields, capacity); 7,500 of them are ~100 MB, so a page is read with a size bound (`MAX_PAGE_BYTES`) and
decoded by msgspec into small typed structs in a worker thread, skipping every field the view does not use.
The structs are `gc=False` (they never form a cycle): 7,500 nodes' worth of them would otherwise trigger
collections that re-scan every one. A page that is not a NodeList (wrong types, not JSON) is refused whole as
ApiServerError 502: a view that silently dropped nodes would report a healthier fleet than there is.
"""

from __future__ import annotations

import msgspec

from agent.kube import errors

MAX_PAGE_BYTES = 128 << 20  # 500 nodes at the largest realistic size (~50 kB with 50 images) are ~25 MB


class NodeCondition(msgspec.Struct, frozen=True, gc=False):
    """One entry of status.conditions."""

    type: str = ""
    status: str = ""
    reason: str = ""
    message: str = ""


class NodeTaint(msgspec.Struct, frozen=True, gc=False):
    """One entry of spec.taints."""

    key: str = ""
    effect: str = ""
    value: str = ""


class _Meta(msgspec.Struct, frozen=True, gc=False):
    name: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class _Spec(msgspec.Struct, frozen=True, gc=False):
    unschedulable: bool = False
    taints: list[NodeTaint] | None = None


class _Status(msgspec.Struct, frozen=True, gc=False):
    conditions: list[NodeCondition] | None = None


class _Node(msgspec.Struct, frozen=True, gc=False):
    metadata: _Meta = _Meta()
    spec: _Spec = _Spec()
    status: _Status = _Status()


class _ListMeta(msgspec.Struct, frozen=True, gc=False):
    resourceVersion: str = ""
    continue_: str = msgspec.field(default="", name="continue")


class _NodeList(msgspec.Struct, frozen=True, gc=False):
    kind: str = ""
    metadata: _ListMeta = _ListMeta()
    items: list[_Node] | None = None


_DECODER = msgspec.json.Decoder(_NodeList)


class NodeSummary(msgspec.Struct, frozen=True, gc=False):
    """What a fleet view reads of one Node: name, labels, annotations, cordon, taints and conditions."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    unschedulable: bool
    taints: tuple[NodeTaint, ...]
    conditions: tuple[NodeCondition, ...]

    def condition(self, kind: str) -> NodeCondition | None:
        """The condition of this type (the first, should a server repeat one)."""
        return next((c for c in self.conditions if c.type == kind), None)

    def has_taint(self, key: str) -> bool:
        """A taint with this key, whatever its effect."""
        return any(t.key == key for t in self.taints)


class NodePage(msgspec.Struct, frozen=True, gc=False):
    """One LIST answer: its nodes and the `continue` token (empty: the list is complete)."""

    nodes: tuple[NodeSummary, ...]
    continue_token: str
    resource_version: str


def decode_node_page(body: bytes | bytearray) -> NodePage:
    """Decode a NodeList answer (blocking: run it in a thread); ApiServerError 502 for anything else."""
    try:
        listing = _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.ApiServerError(502, f"undecodable node list: {str(exc)[:200]}") from exc
    if listing.kind != "NodeList":  # a Status, a proxy's page, another resource: never "no nodes"
        raise errors.ApiServerError(502, f"the node list answer is a {listing.kind[:40] or 'document without kind'}")
    nodes = tuple(NodeSummary(n.metadata.name, n.metadata.labels or {}, n.metadata.annotations or {},
                              n.spec.unschedulable, tuple(n.spec.taints or ()), tuple(n.status.conditions or ()))
                  for n in listing.items or ())
    if any(not node.name for node in nodes):
        raise errors.ApiServerError(502, "a node list item has no metadata.name")
    return NodePage(nodes, listing.metadata.continue_, listing.metadata.resourceVersion)
