"""The node's hardware model and the sources that build it (sysfs, NCCL topology XML)."""
