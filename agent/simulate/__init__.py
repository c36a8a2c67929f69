"""Simulated nodes: built-in profiles (data files), a sysfs tree writer, and simulated NVML identities."""
