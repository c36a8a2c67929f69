"""Network accounting: iptables mangle rules and ipset counters for internet vs cluster traffic, per node and pod.

Modules: `backend` (the only code running iptables/ipset), `ipset_netlink` (fast counter reads), `rules` and
`ipsets` (desired state and diffs), `counters` (monotonic totals), `engine` (one lock around reads and changes),
`collector` (Prometheus), `service` (the loop), `command` (`netacct cleanup`). The pods and the pod source
come from `agent.pods` (shared with shaping, one source per process).
"""
