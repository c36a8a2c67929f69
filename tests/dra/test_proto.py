"""The DRA and plugin-registration wire contracts, as the kubelet dials them.

The committed stubs are checked against the generator by `tests/test_proto.py`; here the schema is pinned to the
reference tables (`dra.md` sections 2-4, `dropin.md` 2.4): full service names, rpcs, field numbers.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

from agent.dra.health.v1alpha1 import api_pb2 as health_v1alpha1
from agent.dra.v1 import api_pb2 as dra_v1
from agent.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.pluginregistration.v1 import api_pb2 as registration_v1

_FDP = descriptor_pb2.FieldDescriptorProto
DRA_FIELDS = {
    "Claim": [(1, "namespace"), (2, "uid"), (3, "name")],
    "NodePrepareResourcesRequest": [(1, "claims")],
    "NodePrepareResourcesResponse": [(1, "claims")],
    "NodePrepareResourceResponse": [(1, "devices"), (2, "error")],
    "Device": [(1, "request_names"), (2, "pool_name"), (3, "device_name"), (4, "cdi_device_ids")],
    "NodeUnprepareResourcesRequest": [(1, "claims")],
    "NodeUnprepareResourcesResponse": [(1, "claims")],
    "NodeUnprepareResourceResponse": [(1, "error")],
}


def _fields(module: ModuleType, message: str) -> list[tuple[int, str]]:
    return sorted((f.number, f.name) for f in module.DESCRIPTOR.message_types_by_name[message].fields)


@pytest.mark.parametrize(("module", "version"), [(dra_v1, "v1"), (dra_v1beta1, "v1beta1")])
def test_dra_service_and_messages(module: ModuleType, version: str) -> None:
    service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
    assert set(service.methods_by_name) == {"NodePrepareResources", "NodeUnprepareResources"}
    for name, expected in DRA_FIELDS.items():
        extra = [(5, "share_id")] if name == "Device" and version == "v1" else []
        assert _fields(module, name) == sorted(expected + extra), name
    response = module.DESCRIPTOR.message_types_by_name["NodePrepareResourcesResponse"].fields_by_name["claims"]
    assert response.message_type.GetOptions().map_entry


def test_share_id_is_optional_in_v1() -> None:
    device = dra_v1.Device(device_name="gpu-0")
    assert not device.HasField("share_id")


def test_plugin_registration() -> None:
    service = registration_v1.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert set(service.methods_by_name) == {"GetInfo", "NotifyRegistrationStatus"}
    assert _fields(registration_v1, "PluginInfo") == [(1, "type"), (2, "name"), (3, "endpoint"),
                                                      (4, "supported_versions")]
    assert _fields(registration_v1, "RegistrationStatus") == [(1, "plugin_registered"), (2, "error")]


def test_resource_health() -> None:
    service = health_v1alpha1.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert service.full_name == "v1alpha1.DRAResourceHealth"
    watch = service.methods_by_name["NodeWatchResources"]
    proto = descriptor_pb2.MethodDescriptorProto()
    watch.CopyToProto(proto)
    assert proto.server_streaming and not proto.client_streaming
    assert _fields(health_v1alpha1, "DeviceHealth") == [(1, "device"), (2, "health"), (3, "last_updated_time"),
                                                       (4, "health_check_timeout_seconds"), (5, "message")]
    assert health_v1alpha1.HealthStatus.Value("UNHEALTHY") == 2
