"""Generated gRPC stubs (scripts/gen_proto.py from proto/dra/health/v1alpha1/api.proto); do not edit."""
