"""The eBPF accounting layout's pure parts: an instruction assembler, the counting program builder, map formats.

Nothing here calls the kernel; `agent.host.bpf` is the only module that issues bpf(2).
"""
