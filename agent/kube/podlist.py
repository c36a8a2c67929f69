"""Decoding a pod LIST answer off the event loop, believing only the pods of this node.

Two hostile answers shape it. A server or proxy that ignores `fieldSelector=spec.nodeName=<node>` answers with
every pod it has (tens of thousands): each pod whose `spec.nodeName` is another node is skipped and counted, never
taken for one of ours (drain would evict it, ownership would pair its devices). And such an answer is megabytes:
lightkube decoded it on the loop, building a model per pod, and held every subsystem for ~1 s at 20,000 pods.
Here the body is read in chunks with a size bound (`MAX_LIST_BYTES`), then decoded in a worker thread in small
steps: the outer document with every item left raw (one scan, ~ms per MB), then item by item, a node check before
the full decode. Each step is one short C call, so the loop gets the GIL back between them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from agent.kube import errors
from agent.kube.model import PodView

MAX_LIST_BYTES = 16 << 20  # a node's pods (250 at ~15 kB) are a few MB; past this an answer is refused


class _Meta(msgspec.Struct):
    resourceVersion: str = ""


class _RawList(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    items: list[msgspec.Raw] | None = None


class _Spec(msgspec.Struct):
    nodeName: str = ""


class _NodeOnly(msgspec.Struct):
    spec: _Spec = msgspec.field(default_factory=_Spec)


_LIST = msgspec.json.Decoder(_RawList)
_NODE = msgspec.json.Decoder(_NodeOnly)
_ANY = msgspec.json.Decoder()


@dataclass(frozen=True)
class DecodedPods:
    """This node's pods of one LIST answer, the list's resourceVersion, and how many pods of other nodes it held."""

    pods: tuple[PodView, ...]
    resource_version: str
    foreign: int


async def read_bounded(chunks: AsyncIterator[bytes], limit: int = MAX_LIST_BYTES, what: str = "pod list") -> bytearray:
    """The body, refused (ApiServerError 502) once it passes `limit` bytes."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise errors.ApiServerError(502, f"a {what} answer over {limit >> 20} MiB was refused")
    return body


def decode_node_pods(body: bytes | bytearray, node: str) -> DecodedPods:
    """Decode a PodList answer, keeping the pods on `node` (blocking: run it in a thread). ApiServerError 502 for
    a body that is not a pod list."""
    try:
        listing = _LIST.decode(body)
        pods: list[PodView] = []
        foreign = 0
        for raw in listing.items or ():
            if _NODE.decode(raw).spec.nodeName != node:
                foreign += 1
                continue
            pod = _ANY.decode(raw)
            if not isinstance(pod, dict):
                raise errors.ApiServerError(502, "a pod list item is not an object")
            pods.append(PodView.from_dict(pod))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise errors.ApiServerError(502, f"undecodable pod list: {exc}") from exc
    return DecodedPods(tuple(pods), listing.metadata.resourceVersion, foreign)


def status_message(body: bytes) -> str:
    """The message of a Status answer, or the start of the body."""
    try:
        status = _ANY.decode(body)
    except msgspec.DecodeError:
        return body[:200].decode(errors="replace")
    return str(status.get("message") or "") if isinstance(status, dict) else body[:200].decode(errors="replace")
