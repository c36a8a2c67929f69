"""Ports to the machine: everything outside the process that the agent reads, each with a simulated twin."""
