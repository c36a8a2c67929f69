"""The fleet view's Node LIST decoder on a real Node: Kubernetes' own round-trip fixture of a v1 Node, every field
filled as the API server serializes it (tests/kube/data/kubernetes/SOURCES.md), in a NodeList page. Fields the view
does not read (managedFields, images, nodeInfo, taints' timeAdded, conditions' times) are skipped, the ones it reads
come out as the server wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.kube import errors
from agent.kube.nodelist import NodeCondition, NodeTaint, decode_node_page

NODE = json.loads((Path(__file__).parent / "data" / "kubernetes" / "core.v1.Node.json").read_text(encoding="utf-8"))


def _page(*items: dict, cont: str = "") -> bytes:
    meta = {"resourceVersion": "4711", **({"continue": cont} if cont else {})}
    return json.dumps({"kind": "NodeList", "apiVersion": "v1", "metadata": meta, "items": list(items)}).encode()


def test_the_kubernetes_node_fixture_decodes_to_what_the_view_reads() -> None:
    page = decode_node_page(_page(NODE, cont="eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ"))
    assert (page.resource_version, page.continue_token) == ("4711", "eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ")
    (node,) = page.nodes
    assert node.name == "nameValue"
    assert node.labels == {"labelsKey": "labelsValue"}
    assert node.annotations == {"annotationsKey": "annotationsValue"}
    assert node.unschedulable is True
    assert node.taints == (NodeTaint("keyValue", "effectValue", "valueValue"),)
    assert node.conditions == (NodeCondition("typeValue", "statusValue", "reasonValue", "messageValue"),)
    assert node.condition("typeValue") == node.conditions[0] and node.has_taint("keyValue")


def test_the_fixture_itself_is_not_a_page() -> None:
    """A single Node answered where a NodeList was asked for is refused, never read as no nodes."""
    with pytest.raises(errors.ApiServerError) as raised:
        decode_node_page(json.dumps(NODE).encode())
    assert raised.value.code == 502 and "a Node" in raised.value.message
