"""This node's pods for the network subsystems: the pod model, the pod sources, and the internal set.

Below both netacct and shaping and importing neither, so neither imports the other: `model` (`Pod`, the pods
file format), `source` (`PodSource`, `PodFeed`, `FilePodSource`), `kube` (`KubePodSource`, the Kubernetes pod
watch as a source, and `addressed`, which pods count as having their own addresses), `choice` (`open_pod_source`,
the one choice between the pods file, the API and nothing).

The settings behind them (`netacct.podsFile` / `--pods-file` and `netacct.internalCidrs` / `--internal-cidr`)
keep their keys in the `netacct` section (no key, flag or variable renamed) and are validated in
`agent.config.pods`, the foundation layer below this package, so a bad CIDR still exits with code 2 at load
time. The composition root reads them once and hands both subsystems the same pod source and internal set.
"""
