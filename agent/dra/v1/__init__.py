"""Generated gRPC stubs (scripts/gen_proto.py from proto/dra/v1/api.proto); do not edit."""
