"""Generated Python code for the kubelet device-plugin API v1beta1.

The modules here (``api_pb2``, ``api_pb2_grpc`` and the ``api_pb2.pyi`` stub) are generated
from ``proto/deviceplugin/v1beta1/api.proto`` and committed; do not edit them by hand.
Regenerate with ``python scripts/gen_proto.py`` (it requires the grpcio-tools version pinned in
pyproject.toml); ``tests/test_proto.py`` fails if the committed files drift from the proto.

Nothing is re-exported, so importing this package stays cheap: import
``agent.deviceplugin.v1beta1.api_pb2`` / ``api_pb2_grpc`` explicitly where gRPC is needed.
"""
