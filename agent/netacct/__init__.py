"""Network accounting: internet vs cluster traffic per node and pod, counted by the kernel in one of two layouts.

Modules: `layout` (the layout protocol and the one choice between layouts), `nft_table` with `nft_layout` and
`nft_probe` (the native nftables layout), `iptables_table` with `rules` and `ipsets` (the iptables layout: mangle
chains and ipsets), `carry` (a migration's totals), `repair` (state someone else changed), `counters` (monotonic
totals), `engine` (one lock around reads and changes, migrations), `collector` (Prometheus), `service` (the loop),
`command` (`netacct cleanup`). Every command runs through the netfilter port, `agent.host.netfilter`. The pods and
the pod source come from `agent.pods` (shared with shaping, one source per process).
"""
