"""NVSentinel's platform-connector wire contract as the agent's own proto states it (proto/nvsentinel/v1/api.proto):
the package, service and method names, and every field's number and type, against the field list published in
NVIDIA/NVSentinel:data-models/protobufs/health_event.proto (reference: ../shared/reference/fleet.md section 2).
A renamed field or a changed number would make the connector read our events wrongly without any error."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from agent.host.nvsentinel.v1 import api_pb2

T = FieldDescriptor
HEALTH_EVENT = {  # name: (number, type, repeated)
    "version": (1, T.TYPE_UINT32, False), "agent": (2, T.TYPE_STRING, False),
    "componentClass": (3, T.TYPE_STRING, False), "checkName": (4, T.TYPE_STRING, False),
    "isFatal": (5, T.TYPE_BOOL, False), "isHealthy": (6, T.TYPE_BOOL, False), "message": (7, T.TYPE_STRING, False),
    "recommendedAction": (8, T.TYPE_ENUM, False), "errorCode": (9, T.TYPE_STRING, True),
    "entitiesImpacted": (10, T.TYPE_MESSAGE, True), "metadata": (11, T.TYPE_MESSAGE, True),
    "generatedTimestamp": (12, T.TYPE_MESSAGE, False), "nodeName": (13, T.TYPE_STRING, False),
    "quarantineOverrides": (14, T.TYPE_MESSAGE, False), "drainOverrides": (15, T.TYPE_MESSAGE, False),
    "processingStrategy": (16, T.TYPE_ENUM, False), "id": (17, T.TYPE_STRING, False),
    "customRecommendedAction": (18, T.TYPE_STRING, False),
}


def _fields(message) -> dict[str, tuple[int, int, bool]]:
    return {f.name: (f.number, f.type, f.is_repeated) for f in message.DESCRIPTOR.fields}


def test_package_service_and_method():
    service = api_pb2.DESCRIPTOR.services_by_name["PlatformConnector"]
    assert service.full_name == "datamodels.PlatformConnector"
    method = service.methods_by_name["HealthEventOccurredV1"]
    assert method.input_type.full_name == "datamodels.HealthEvents"
    assert method.output_type.full_name == "google.protobuf.Empty"


def test_messages_match_the_published_field_list():
    assert _fields(api_pb2.HealthEvents) == {"version": (1, T.TYPE_UINT32, False),
                                             "events": (2, T.TYPE_MESSAGE, True)}
    assert _fields(api_pb2.HealthEvent) == HEALTH_EVENT
    assert _fields(api_pb2.Entity) == {"entityType": (1, T.TYPE_STRING, False),
                                       "entityValue": (2, T.TYPE_STRING, False)}
    assert _fields(api_pb2.BehaviourOverrides) == {"force": (1, T.TYPE_BOOL, False), "skip": (2, T.TYPE_BOOL, False)}
    entry = api_pb2.HealthEvent.DESCRIPTOR.fields_by_name["metadata"].message_type
    assert entry.GetOptions().map_entry  # map<string, string>
    assert api_pb2.HealthEvent.DESCRIPTOR.fields_by_name["generatedTimestamp"].message_type.full_name == \
        "google.protobuf.Timestamp"


def test_enums_match_the_published_values():
    assert dict(api_pb2.RecommendedAction.items()) == {
        "NONE": 0, "COMPONENT_RESET": 2, "CONTACT_SUPPORT": 5, "RUN_FIELDDIAG": 6, "RESTART_VM": 15,
        "RESTART_BM": 24, "REPLACE_VM": 25, "RUN_DCGMEUD": 26, "CUSTOM": 27, "REMEDIATE": 28, "RESTART_APP": 39,
        "UNKNOWN": 99}
    assert dict(api_pb2.ProcessingStrategy.items()) == {"UNSPECIFIED": 0, "EXECUTE_REMEDIATION": 1, "STORE_ONLY": 2}
