"""Guards for the kubelet device-plugin v1beta1 wire contract and its committed generated code.

Why this exists: the kubelet talks to the agent only through ``v1beta1.Registration`` and
``v1beta1.DevicePlugin``; a renamed field, a changed number or a lost ``stream`` breaks the node
silently. These tests pin (a) that the committed stubs are exactly what the pinned grpcio-tools
generates from ``proto/deviceplugin/v1beta1/api.proto``, (b) the schema itself against a table
transcribed from the reference (``kubelet-device-plugin.md`` section 1) and (c) that the stubs
really serve over a unix socket with grpc.aio, as the kubelet dials them.
"""

from __future__ import annotations

import difflib
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"
GENERATED = tuple(
    Path(package, name)
    for package in ("agent/deviceplugin/v1beta1", "agent/dra/v1", "agent/dra/v1beta1", "agent/dra/health/v1alpha1",
                    "agent/pluginregistration/v1", "agent/host/podresources/v1", "agent/host/nvsentinel/v1")
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")
)

# --- (a) committed code matches the generator --------------------------------------------------


def test_committed_stubs_match_regenerated(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, f"gen_proto.py failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    problems: list[str] = []
    for rel in GENERATED:
        committed, fresh = REPO_ROOT / rel, tmp_path / rel
        if not committed.is_file():
            problems.append(f"{rel}: not committed")
            continue
        old, new = committed.read_text(), fresh.read_text()
        if old != new:
            diff = difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"committed/{rel}",
                tofile=f"regenerated/{rel}",
                n=2,
            )
            problems.append("".join(diff))
    if problems:
        pytest.fail(
            "generated code is stale; run `python scripts/gen_proto.py` and commit the result:\n\n"
            + "\n".join(problems),
            pytrace=False,
        )


# --- (b) wire contract, transcribed from kubelet-device-plugin.md section 1 ---------------------

# Full service name -> {rpc: (input, output, server_streaming)}; client streaming is never used.
SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "v1beta1.Registration": {
        "Register": ("RegisterRequest", "Empty", False),
    },
    "v1beta1.DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}

MAP = "map<string,string>"
# Message -> [(number, name, label, type)]; label is "optional" (proto3 singular) or "repeated";
# type is a scalar name, a v1beta1 message name or MAP.
MESSAGES: dict[str, list[tuple[int, str, str, str]]] = {
    "DevicePluginOptions": [
        (1, "pre_start_required", "optional", "bool"),
        (2, "get_preferred_allocation_available", "optional", "bool"),
    ],
    "RegisterRequest": [
        (1, "version", "optional", "string"),
        (2, "endpoint", "optional", "string"),
        (3, "resource_name", "optional", "string"),
        (4, "options", "optional", "DevicePluginOptions"),
    ],
    "Empty": [],
    "ListAndWatchResponse": [(1, "devices", "repeated", "Device")],
    "TopologyInfo": [(1, "nodes", "repeated", "NUMANode")],
    "NUMANode": [(1, "ID", "optional", "int64")],
    "Device": [
        (1, "ID", "optional", "string"),
        (2, "health", "optional", "string"),
        (3, "topology", "optional", "TopologyInfo"),
    ],
    "PreStartContainerRequest": [(1, "devices_ids", "repeated", "string")],
    "PreStartContainerResponse": [],
    "PreferredAllocationRequest": [
        (1, "container_requests", "repeated", "ContainerPreferredAllocationRequest"),
    ],
    "ContainerPreferredAllocationRequest": [
        (1, "available_deviceIDs", "repeated", "string"),
        (2, "must_include_deviceIDs", "repeated", "string"),
        (3, "allocation_size", "optional", "int32"),
    ],
    "PreferredAllocationResponse": [
        (1, "container_responses", "repeated", "ContainerPreferredAllocationResponse"),
    ],
    "ContainerPreferredAllocationResponse": [(1, "deviceIDs", "repeated", "string")],
    "AllocateRequest": [(1, "container_requests", "repeated", "ContainerAllocateRequest")],
    "ContainerAllocateRequest": [(1, "devices_ids", "repeated", "string")],
    "AllocateResponse": [(1, "container_responses", "repeated", "ContainerAllocateResponse")],
    "ContainerAllocateResponse": [
        (1, "envs", "repeated", MAP),
        (2, "mounts", "repeated", "Mount"),
        (3, "devices", "repeated", "DeviceSpec"),
        (4, "annotations", "repeated", MAP),
        (5, "cdi_devices", "repeated", "CDIDevice"),
    ],
    "Mount": [
        (1, "container_path", "optional", "string"),
        (2, "host_path", "optional", "string"),
        (3, "read_only", "optional", "bool"),
    ],
    "DeviceSpec": [
        (1, "container_path", "optional", "string"),
        (2, "host_path", "optional", "string"),
        (3, "permissions", "optional", "string"),
    ],
    "CDIDevice": [(1, "name", "optional", "string")],
}

_FDP = descriptor_pb2.FieldDescriptorProto
_LABELS = {_FDP.LABEL_OPTIONAL: "optional", _FDP.LABEL_REPEATED: "repeated", _FDP.LABEL_REQUIRED: "required"}
_SCALARS = {
    _FDP.TYPE_BOOL: "bool",
    _FDP.TYPE_STRING: "string",
    _FDP.TYPE_INT32: "int32",
    _FDP.TYPE_INT64: "int64",
}


@pytest.fixture(scope="module")
def file_proto() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    api_pb2.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def _field_type(field: descriptor_pb2.FieldDescriptorProto, msg: descriptor_pb2.DescriptorProto) -> str:
    if field.type in _SCALARS:
        return _SCALARS[field.type]
    assert field.type == _FDP.TYPE_MESSAGE, f"{msg.name}.{field.name}: unexpected type {field.type}"
    for nested in msg.nested_type:
        if field.type_name == f".v1beta1.{msg.name}.{nested.name}" and nested.options.map_entry:
            kv = {f.name: _SCALARS.get(f.type) for f in nested.field}
            return f"map<{kv['key']},{kv['value']}>"
    assert field.type_name.startswith(".v1beta1."), field.type_name
    return field.type_name.removeprefix(".v1beta1.")


def test_file_header(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    assert file_proto.syntax == "proto3"
    assert file_proto.package == "v1beta1"
    assert file_proto.options.go_package == "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
    assert list(file_proto.dependency) == [], "no imports (gogoproto must stay out)"


def test_services_and_rpcs() -> None:
    services = api_pb2.DESCRIPTOR.services_by_name
    assert {s.full_name for s in services.values()} == set(SERVICES)
    for full_name, rpcs in SERVICES.items():
        service = services[full_name.removeprefix("v1beta1.")]
        assert set(service.methods_by_name) == set(rpcs), full_name
        for rpc, (req, resp, server_streaming) in rpcs.items():
            method = service.methods_by_name[rpc]
            assert method.input_type.full_name == f"v1beta1.{req}", f"{full_name}/{rpc} input"
            assert method.output_type.full_name == f"v1beta1.{resp}", f"{full_name}/{rpc} output"
            mproto = descriptor_pb2.MethodDescriptorProto()
            method.CopyToProto(mproto)
            assert mproto.server_streaming is server_streaming, f"{full_name}/{rpc} server streaming"
            assert mproto.client_streaming is False, f"{full_name}/{rpc} client streaming"


def test_messages(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    assert {m.name for m in file_proto.message_type} == set(MESSAGES)
    for msg in file_proto.message_type:
        actual = sorted((f.number, f.name, _LABELS[f.label], _field_type(f, msg)) for f in msg.field)
        assert actual == sorted(MESSAGES[msg.name]), msg.name
        assert not any(f.HasField("oneof_index") for f in msg.field), f"{msg.name}: unexpected oneof"


def test_python_attribute_names_keep_mixed_case() -> None:
    req = api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=["a", "b"], must_include_deviceIDs=["a"], allocation_size=1
    )
    resp = api_pb2.ContainerPreferredAllocationResponse(deviceIDs=["a"])
    dev = api_pb2.Device(ID="GPU-0", health="Healthy", topology=api_pb2.TopologyInfo(nodes=[{"ID": 1}]))
    assert list(req.available_deviceIDs) == ["a", "b"]
    assert list(resp.deviceIDs) == ["a"]
    assert api_pb2.Device.FromString(dev.SerializeToString()) == dev
    assert list(api_pb2.ContainerAllocateRequest(devices_ids=["x"]).devices_ids) == ["x"]


# --- (c) round trip over a real unix socket ------------------------------------------------------


class _OptionsOnlyPlugin(api_pb2_grpc.DevicePluginServicer):
    """Minimal DevicePlugin: the RPCs the kubelet calls first after registering."""

    async def GetDevicePluginOptions(  # name fixed by the gRPC service
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(  # name fixed by the gRPC service
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID="dev0", health="Healthy")])


@pytest.fixture
def socket_path() -> Iterator[str]:
    # pytest's tmp_path can exceed the 107-byte AF_UNIX sun_path limit; mkdtemp under /tmp does not.
    directory = tempfile.mkdtemp(prefix="gna")
    try:
        yield str(Path(directory) / "dp.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_unix_socket_round_trip(socket_path: str) -> None:
    server = grpc.aio.server()
    api_pb2_grpc.add_DevicePluginServicer_to_server(_OptionsOnlyPlugin(), server)
    assert server.add_insecure_port(f"unix://{socket_path}") == 1
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
            assert options == api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
            assert options.pre_start_required is False

            updates = [r async for r in stub.ListAndWatch(api_pb2.Empty(), timeout=10)]
            assert [[(d.ID, d.health) for d in u.devices] for u in updates] == [[("dev0", "Healthy")]]
    finally:
        await server.stop(grace=None)
    log.debug("round trip over %s ok", socket_path)
