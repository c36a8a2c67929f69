"""The kubelet PodResources v1 wire contract, pinned against the reference table.

Why this exists: the agent reads which container holds which device from the kubelet's
``v1.PodResourcesLister``; a renumbered field would decode silently into empty lists. The table below is
transcribed from ``podresources.md`` section 2 (kubernetes/kubelet:pkg/apis/podresources/v1/api.proto at
63b3249); regeneration of the committed stubs is checked in ``test_proto.py``.
"""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2

from agent.host.podresources.v1 import api_pb2

SERVICE = "v1.PodResourcesLister"
RPCS = {
    "List": ("ListPodResourcesRequest", "ListPodResourcesResponse"),
    "GetAllocatableResources": ("AllocatableResourcesRequest", "AllocatableResourcesResponse"),
    "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse"),
}

MESSAGES: dict[str, list[tuple[int, str, str, str]]] = {
    "ListPodResourcesRequest": [],
    "ListPodResourcesResponse": [(1, "pod_resources", "repeated", "PodResources")],
    "AllocatableResourcesRequest": [],
    "AllocatableResourcesResponse": [
        (1, "devices", "repeated", "ContainerDevices"),
        (2, "cpu_ids", "repeated", "int64"),
        (3, "memory", "repeated", "ContainerMemory"),
    ],
    "GetPodResourcesRequest": [(1, "pod_name", "optional", "string"), (2, "pod_namespace", "optional", "string")],
    "GetPodResourcesResponse": [(1, "pod_resources", "optional", "PodResources")],
    "PodResources": [
        (1, "name", "optional", "string"),
        (2, "namespace", "optional", "string"),
        (3, "containers", "repeated", "ContainerResources"),
        (4, "cpu_ids", "repeated", "int64"),
        (5, "memory", "repeated", "ContainerMemory"),
    ],
    "ContainerResources": [
        (1, "name", "optional", "string"),
        (2, "devices", "repeated", "ContainerDevices"),
        (3, "cpu_ids", "repeated", "int64"),
        (4, "memory", "repeated", "ContainerMemory"),
        (5, "dynamic_resources", "repeated", "DynamicResource"),
    ],
    "ContainerDevices": [
        (1, "resource_name", "optional", "string"),
        (2, "device_ids", "repeated", "string"),
        (3, "topology", "optional", "TopologyInfo"),
    ],
    "ContainerMemory": [
        (1, "memory_type", "optional", "string"),
        (2, "size", "optional", "uint64"),
        (3, "topology", "optional", "TopologyInfo"),
    ],
    "TopologyInfo": [(1, "nodes", "repeated", "NUMANode")],
    "NUMANode": [(1, "ID", "optional", "int64")],
    "DynamicResource": [
        (2, "claim_name", "optional", "string"),
        (3, "claim_namespace", "optional", "string"),
        (4, "claim_resources", "repeated", "ClaimResource"),
    ],
    "ClaimResource": [
        (1, "cdi_devices", "repeated", "CDIDevice"),
        (2, "driver_name", "optional", "string"),
        (3, "pool_name", "optional", "string"),
        (4, "device_name", "optional", "string"),
        (5, "share_id", "optional", "string"),
    ],
    "CDIDevice": [(1, "name", "optional", "string")],
}

_FDP = descriptor_pb2.FieldDescriptorProto
_LABELS = {_FDP.LABEL_OPTIONAL: "optional", _FDP.LABEL_REPEATED: "repeated"}
_SCALARS = {_FDP.TYPE_STRING: "string", _FDP.TYPE_INT64: "int64", _FDP.TYPE_UINT64: "uint64"}


@pytest.fixture(scope="module")
def file_proto() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    api_pb2.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def test_file_header(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    assert file_proto.syntax == "proto3"
    assert file_proto.package == "v1"
    assert file_proto.options.go_package == "k8s.io/kubelet/pkg/apis/podresources/v1"
    assert list(file_proto.dependency) == [], "no imports (gogoproto must stay out)"


def test_service() -> None:
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == SERVICE
    assert set(service.methods_by_name) == set(RPCS)
    for rpc, (req, resp) in RPCS.items():
        method = service.methods_by_name[rpc]
        mproto = descriptor_pb2.MethodDescriptorProto()
        method.CopyToProto(mproto)
        assert (method.input_type.full_name, method.output_type.full_name) == (f"v1.{req}", f"v1.{resp}")
        assert not mproto.server_streaming and not mproto.client_streaming, f"{rpc} is unary"


def test_messages(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    assert {m.name for m in file_proto.message_type} == set(MESSAGES)
    for msg in file_proto.message_type:
        actual = []
        for f in msg.field:
            kind = _SCALARS.get(f.type) or f.type_name.removeprefix(".v1.")
            actual.append((f.number, f.name, _LABELS[f.label], kind))
        assert sorted(actual) == sorted(MESSAGES[msg.name]), msg.name


def test_dynamic_resource_keeps_the_class_name_tombstone(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    dynamic = next(m for m in file_proto.message_type if m.name == "DynamicResource")
    assert [(r.start, r.end) for r in dynamic.reserved_range] == [(1, 2)]
    share = next(m for m in file_proto.message_type if m.name == "ClaimResource").field[4]
    assert share.proto3_optional, "share_id is `optional string` (presence tracked)"


def test_upper_case_numa_id_round_trips() -> None:
    devices = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-1"],
                                       topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=1)]))
    again = api_pb2.ContainerDevices.FromString(devices.SerializeToString())
    assert again.topology.nodes[0].ID == 1
    assert list(again.device_ids) == ["GPU-1"]
