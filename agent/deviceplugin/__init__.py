"""Kubelet device-plugin (v1beta1) servers for RDMA NIC VFs and GPUs."""
