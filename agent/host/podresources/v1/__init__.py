"""Generated kubelet PodResources v1 stubs (scripts/gen_proto.py from proto/podresources/v1/api.proto)."""
