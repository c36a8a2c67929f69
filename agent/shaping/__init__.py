"""Per-pod internet bandwidth shaping: limits from pod annotations and namespace defaults, applied with kernel
traffic control on each pod's host-side interface, to internet traffic only.

Mechanism, and why (reference shaping.md §2-§3). The kernel this must run on has HTB, TBF, clsact, u32, mirred
and IFB, but no `fq` (so no EDT pacing), no `act_connmark`/`act_ctinfo` (so no conntrack marks at tc ingress)
and no `fw`/`flower`/`police`. Per pod, on its host-side veth:

- downloads (internet -> pod) leave the host through the veth's egress: an HTB root whose default class is the
  pod's limit, with one u32 filter per internal CIDR on the *source* address sending cluster traffic to HTB's
  direct queue (unshaped);
- uploads (pod -> internet) enter the host at the veth's ingress: `clsact` with one u32 per internal CIDR on the
  *destination* (no action: the packet goes on) and last a match-all `mirred` redirect to the pod's own IFB,
  which carries the same HTB at the upload limit.

The veth sees pod addresses in both directions, before MASQUERADE on the uplink (uploads) and after its reverse
(downloads), so attribution needs no netfilter state and works for routed veths (Calico, Azure CNI transparent,
Cilium legacy routing) and for veths on a bridge (bridge, flannel) alike. Per packet: at most one u32 compare per
internal CIDR of its family plus the pod's own HTB, whatever the number of pods; unshaped pods and the uplink get
no qdisc at all. Rejected: classes on the uplink keyed by netacct's marks (every node packet through one HTB lock
on a multi-queue NIC; downloads need `act_connmark`, absent here), EDT + fq (absent, and needs BPF to stamp
forwarded packets), policing (drops instead of queueing; `act_police` absent), the CNI bandwidth plugin (shapes
cluster traffic too).

Finding the interface: the route to the pod IP names it (routed CNIs); when the route names a bridge, the
bridge's neighbour entry gives the pod's MAC and the forwarding database its port. Not found yet: the pod is
`pending` and retried. Interfaces whose root qdisc or ingress hook belongs to someone else (the CNI bandwidth
plugin, an eBPF CNI such as Cilium or Calico-eBPF) are reported as `conflict` and never touched; pods without a
host-side veth (hostNetwork, ipvlan/macvlan, eBPF host routing) and RDMA traffic (kernel bypass) are not shaped.

Modules: `limits` (annotations and defaults), `engine` (reconcile, counters, removal), `collector`
(Prometheus), `service` (the loop and Events), `command` (`shaping cleanup`). The tc port is
`agent.host.tc` (real: `tc_netlink`, simulated: `tc_simulated`).
"""
