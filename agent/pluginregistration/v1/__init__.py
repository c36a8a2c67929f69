"""Generated gRPC stubs (scripts/gen_proto.py from proto/pluginregistration/v1/api.proto); do not edit."""
