"""Kubelet plugin-watcher registration API (generated stubs below), shared by every plugin the kubelet watches."""
