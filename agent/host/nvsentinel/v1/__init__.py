"""Generated NVSentinel platform-connector stubs (scripts/gen_proto.py from proto/nvsentinel/v1/api.proto)."""
