"""Generated Python code for the kubelet plugin registration API v1 (package `pluginregistration`).

``api_pb2``, ``api_pb2_grpc`` and ``api_pb2.pyi`` are generated from ``proto/pluginregistration/v1/api.proto``
and committed; do not edit them by hand. Regenerate with ``python scripts/gen_proto.py``; ``tests/test_proto.py``
fails if the committed files drift from the proto.
"""
