"""PCIe-aware placement of GPUs and RDMA NIC devices: the pure policy and the joint allocator around it.

Layers: `tree` (the PCIe groups of a `Topology`) <- `score` (what a choice is worth) <- `search` (the exact best
counts per group) <- `policy` (one container request of one kind: validation and the choice) <- `admission`
(which devices of the other kind this container just got) <- `joint` (one allocator shared by every resource
served). Nothing here imports `agent.deviceplugin`: the servicer hands plain data in and counts the reasons and
levels that come back (`deviceplugin -> placement -> topology`).
"""
