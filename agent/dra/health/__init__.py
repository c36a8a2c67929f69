"""Health APIs of the kubelet DRA plugin (generated stubs below)."""
