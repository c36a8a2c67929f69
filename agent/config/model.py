"""The agent's settings: one typed object, one section per subsystem.

Each field says how an operator sets it: its config-file key is the camelCase of the field name (snake_case is
accepted too), `flag` is the command-line flag and `env` the environment variable. Precedence, lowest first:
defaults, config file, environment, flags. Loading and validation live in `agent.config.load`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.config.address import parse_address
from agent.config.fields import PROJECT_DOMAIN, setting
from agent.config.files import check_dirs, check_files
from agent.config.health import HealthConfig
from agent.config.labels import NodeLabelsConfig
from agent.config.names import check_node_name
from agent.config.netacct import NetacctConfig
from agent.config.remediation import RemediationConfig, check_sentinel_path
from agent.config.resources import resource_name_problem, vf_range_problem
from agent.config.shaping import ShapingConfig
from agent.config.sharing import ALLOCATION_POLICIES, TimeSlicingConfig

CONFIG_VERSION = 1
DEFAULT_RESOURCE_PREFIX = PROJECT_DOMAIN
# NVIDIA k8s-device-plugin's deviceListStrategy values (api/config/v1/strategy.go)
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
# A full hardware rescan (sysfs walk, NVML) at most this often: at 0.01 s it took 46 % of a core
RESCAN_FLOOR_S = 1.0


@dataclass
class TopologyConfig:
    """Where the node's hardware model comes from."""

    sysfs_root: str = setting("/sys", flag="--sysfs-root", env="GPU_NODE_AGENT_SYSFS_ROOT",
                              help="root of the sysfs tree to read (a simulated tree in tests)")
    topology_file: str | None = setting(
        None, flag="--topology-file", env="GPU_NODE_AGENT_TOPOLOGY_FILE",
        help="NCCL topology XML that gives the true PCIe tree (cloud VMs); sysfs still names RDMA devices and VFs")
    simulate: str | None = setting(
        None, flag="--simulate", env="GPU_NODE_AGENT_SIMULATE",
        help="run on a built-in simulated node profile instead of the host (e.g. dgx-h100)")
    rescan_interval_seconds: float = setting(
        300.0, flag="--rescan-interval", env="GPU_NODE_AGENT_RESCAN_INTERVAL",
        floor=RESCAN_FLOOR_S, help="seconds between hardware rescans (SIGHUP rescans at once, at most once a second)")
    data_direct_vfs: bool = setting(
        True, flag="--data-direct-vfs", env="GPU_NODE_AGENT_DATA_DIRECT_VFS",
        help="place the VFs of a ConnectX-8 Data Direct NIC at its DMA function, like the PF (false: by the VF's "
             "own path; set false unless Data Direct was enabled per VF in firmware)")


@dataclass
class SelectorConfig:
    """SR-IOV device-plugin style selectors; empty lists match everything."""

    vendors: list[str] = setting(factory=list, help="PCI vendor ids, e.g. 15b3")
    devices: list[str] = setting(factory=list, help="PCI device ids, e.g. 101e")
    drivers: list[str] = setting(factory=list, help="bound kernel drivers, e.g. mlx5_core")
    pf_names: list[str] = setting(factory=list, help="netdev names of the physical function; 'ens1f0#0-3,6' "
                                                     "limits it to those VF indexes")
    link_types: list[str] = setting(factory=list, help="link types: infiniband or ether")
    is_rdma: bool | None = setting(None, help="only RDMA-capable functions (true) or only non-RDMA (false)")
    pci_addresses: list[str] = setting(factory=list,
                                       help="bus ids of the functions themselves, e.g. 0000:1a:00.2")
    root_devices: list[str] = setting(factory=list, help="bus ids of the physical function; like pfNames, "
                                                          "'<bdf>#0-3,6' limits it to those VF indexes")

    def check(self) -> None:
        """A VF range that cannot be read would silently match nothing: refuse it."""
        for key, entries in (("pfNames", self.pf_names), ("rootDevices", self.root_devices)):
            for index, entry in enumerate(entries):
                problem = vf_range_problem(entry)
                if problem:
                    raise ValueError(f"{key}[{index}]: {problem}")


@dataclass
class PoolConfig:
    """One extended resource served by the agent."""

    resource_name: str = setting("", help="resource name without prefix, e.g. sriov_rdma")
    resource_prefix: str | None = setting(None, help="resource prefix; the device plugin's default when empty")
    selectors: SelectorConfig = setting(factory=SelectorConfig, help="which devices join this pool")
    selector_list: list[SelectorConfig] = setting(
        factory=list, help="more selector objects (SR-IOV device plugin's list form): a device also joins when "
                           "it matches any of these")
    exclude_topology: bool = setting(False, help="do not report the devices' NUMA node to the kubelet "
                                                 "(SR-IOV device plugin's excludeTopology)")

    def check(self) -> None:
        """The pool's own name (and prefix, when it sets one) must be an extended resource name."""
        problem = resource_name_problem(self.resource_prefix or DEFAULT_RESOURCE_PREFIX, self.resource_name)
        if problem:
            raise ValueError(f"resourceName/resourcePrefix: {problem}")


def _default_pools() -> list[PoolConfig]:
    return [PoolConfig(resource_name="sriov_rdma", selectors=SelectorConfig(is_rdma=True))]


@dataclass
class DevicePluginConfig:
    """Kubelet device-plugin servers."""

    enabled: bool = setting(True, flag="--device-plugin", env="GPU_NODE_AGENT_DEVICE_PLUGIN",
                            help="serve the kubelet device-plugin API")
    device_plugin_dir: str = setting(
        "/var/lib/kubelet/device-plugins", flag="--device-plugin-dir", env="GPU_NODE_AGENT_DEVICE_PLUGIN_DIR",
        help="kubelet device-plugin directory (kubelet.sock and the plugin sockets)")
    registration_mode: str = setting(
        "auto", flag="--registration-mode", env="GPU_NODE_AGENT_REGISTRATION_MODE",
        choices=("auto", "kubelet-sock", "plugin-watcher"),
        help="how resources register: Register on kubelet.sock, a socket in the kubelet's plugin-watcher "
             "directory (--plugin-registry-dir), or auto (the watcher when that directory exists, as SR-IOV DP does)")
    resource_prefix: str = setting(DEFAULT_RESOURCE_PREFIX, flag="--resource-prefix",
                                   env="GPU_NODE_AGENT_RESOURCE_PREFIX",
                                   help="domain prefix of the NIC resources (<prefix>/sriov_rdma); set, it is also "
                                        "the prefix of SR-IOV file pools without resourcePrefix, as the SR-IOV "
                                        "plugin's -resource-prefix")
    serve_gpus: bool | None = setting(
        None, flag="--serve-gpus", env="GPU_NODE_AGENT_SERVE_GPUS",
        help="also serve whole GPUs (replaces NVIDIA's device plugin on this node); unset means on only with "
             "--simulate, where no other GPU plugin runs")
    gpu_resource_name: str = setting("nvidia.com/gpu", flag="--gpu-resource-name",
                                     env="GPU_NODE_AGENT_GPU_RESOURCE_NAME",
                                     help="full resource name of the GPU pool")
    pools: list[PoolConfig] = setting(factory=_default_pools, help="NIC resource pools (first match wins)")
    sriov_dp_config: str | None = setting(
        None, flag="--sriov-dp-config", env="GPU_NODE_AGENT_SRIOV_DP_CONFIG",
        help="the SR-IOV network device plugin's config.json; its resourceList replaces `pools` (no "
             "resourcePrefix means --resource-prefix when set, else intel.com, as there)")
    device_info_dir: str = setting(
        "/var/run/k8s.cni.cncf.io/devinfo/dp", flag="--device-info-dir", env="GPU_NODE_AGENT_DEVICE_INFO_DIR",
        help="where Allocate writes Multus device-info files for NIC devices (device-info spec 1.1.0); empty "
             "writes none")
    rdma_mad_devices: bool = setting(False, flag="--rdma-mad-devices", env="GPU_NODE_AGENT_RDMA_MAD_DEVICES",
                                     help="also pass /dev/infiniband/umad* and issm* to containers")
    gpu_cdi: bool = setting(False, flag="--gpu-cdi", env="GPU_NODE_AGENT_GPU_CDI",
                            help="also name allocated GPUs as CDI devices (<gpuCdiKind>=<UUID>) in Allocate; "
                                 "needs the DevicePluginCDIDevices feature and a CDI spec on the node")
    gpu_cdi_kind: str = setting("nvidia.com/gpu", flag="--gpu-cdi-kind", env="GPU_NODE_AGENT_GPU_CDI_KIND",
                                help="CDI kind (vendor/class) of a GPU spec already on the node, as `nvidia-ctk cdi "
                                     "generate` writes it; names GPUs for the cdi-* strategies")
    device_list_strategy: list[str] = setting(
        factory=lambda: ["envvar"], flag="--device-list-strategy", env="GPU_NODE_AGENT_DEVICE_LIST_STRATEGY",
        help="how Allocate passes GPUs, as NVIDIA's plugin: envvar, volume-mounts, cdi-annotations, cdi-cri "
             "(comma-separated, several allowed)")
    device_id_strategy: str = setting("uuid", flag="--device-id-strategy", env="GPU_NODE_AGENT_DEVICE_ID_STRATEGY",
                                      choices=("uuid", "index"),
                                      help="GPU IDs in NVIDIA_VISIBLE_DEVICES, mounts and CDI names: uuid or index")
    mig_strategy: str = setting(
        "none", flag="--mig-strategy", env="GPU_NODE_AGENT_MIG_STRATEGY", choices=("none", "single", "mixed"),
        help="GPUs in MIG mode, as NVIDIA's plugin: none serves every GPU whole; single serves the MIG devices of "
             "an all-MIG, one-profile node as the GPU resource; mixed serves nvidia.com/mig-<profile> per profile "
             "beside whole GPUs")
    nvidia_dp_config: str | None = setting(
        None, flag="--nvidia-dp-config", env="GPU_NODE_AGENT_NVIDIA_DP_CONFIG",
        help="NVIDIA device plugin's config file (version: v1): its flags become the agent's settings (below "
             "this config, the environment and flags) and sharing.timeSlicing becomes timeSlicing; "
             "sharing.mps is refused")
    time_slicing: TimeSlicingConfig = setting(
        factory=TimeSlicingConfig, help="GPU time-slicing as NVIDIA's sharing.timeSlicing (replicas <id>::<n>)")
    shared_devices_allocation_policy: str = setting(
        "distributed", flag="--shared-devices-allocation-policy",
        env="GPU_NODE_AGENT_SHARED_DEVICES_ALLOCATION_POLICY", choices=ALLOCATION_POLICIES,
        help="preferred allocation of time-sliced replicas, as NVIDIA's: distributed spreads them over GPUs, "
             "packed fills the busiest GPU first")
    pass_device_specs: bool = setting(
        False, flag="--pass-device-specs", env="GPU_NODE_AGENT_PASS_DEVICE_SPECS",
        help="also return the /dev/nvidia* nodes a container needs when no runtime hook adds them (NVIDIA's "
             "passDeviceSpecs; the agent must see the host's /dev/nvidiactl etc.)")
    cdi_annotation_prefix: str = setting(
        "cdi.k8s.io/", flag="--cdi-annotation-prefix", env="GPU_NODE_AGENT_CDI_ANNOTATION_PREFIX",
        help="prefix of the CDI annotation key of the cdi-annotations strategy (nvidia.cdi.k8s.io/ makes the "
             "NVIDIA runtime inject instead of the CRI)")

    rdma_cdi: bool = setting(False, flag="--rdma-cdi", env="GPU_NODE_AGENT_RDMA_CDI",
                             help="write a CDI spec per NIC pool and name RDMA devices in Allocate by annotation "
                                  "instead of device nodes (as SR-IOV DP's -use-cdi)")

    def _check_gpu_serving(self) -> None:
        """The GPU strategies must be NVIDIA's (an unknown one is refused at start, as there)."""
        strategies = [s.strip() for s in self.device_list_strategy if s.strip()]
        unknown = [s for s in strategies if s not in DEVICE_LIST_STRATEGIES]
        if unknown or not strategies:
            raise ValueError(f"deviceListStrategy: {', '.join(unknown) or 'empty'}: use one or more of "
                             f"{', '.join(DEVICE_LIST_STRATEGIES)}")
        if not self.cdi_annotation_prefix.endswith("/"):
            raise ValueError(f"cdiAnnotationPrefix: {self.cdi_annotation_prefix!r} must end with '/'")

    def served_names(self, pools_from: str = "") -> list[tuple[str, str]]:
        """(full resource name, the setting that names it) of every resource this config alone fixes: each NIC
        pool and, unless serveGpus is false, the GPU resource. `pools_from` names the file the pools came from
        (the SR-IOV device plugin's), when they did not come from `pools`. MIG and time-slicing names always carry
        a dot (`mig-1g.10gb`, `gpu.shared`), which neither a pool name nor gpuResourceName may: they cannot meet
        these. Raises ValueError for a name the kubelet would refuse."""
        names: list[tuple[str, str]] = []
        for index, pool in enumerate(self.pools):
            prefix = pool.resource_prefix or self.resource_prefix
            where = f"{pools_from} pool {pool.resource_name!r}" if pools_from else f"pools[{index}]"
            problem = resource_name_problem(prefix, pool.resource_name)
            if problem:
                raise ValueError(f"{'resourcePrefix' if pool.resource_prefix is None else where}: {problem}")
            names.append((f"{prefix}/{pool.resource_name}", where))
        prefix, _, name = self.gpu_resource_name.rpartition("/")
        problem = resource_name_problem(prefix, name) if prefix else "needs a prefix, e.g. nvidia.com/gpu"
        if problem:
            raise ValueError(f"gpuResourceName: {self.gpu_resource_name!r}: {problem}")
        if self.serve_gpus is not False:
            names.append((self.gpu_resource_name, "gpuResourceName (the GPUs)"))
        return names

    def check(self, pools_from: str = "") -> None:
        """Every served resource name is valid and served once (the device plugin crash-looped otherwise): one
        collision is one error naming both settings. Linear in the number of pools."""
        check_files(("sriovDpConfig", self.sriov_dp_config), ("nvidiaDpConfig", self.nvidia_dp_config))
        check_dirs(("devicePluginDir", self.device_plugin_dir), required=True)
        check_dirs(("deviceInfoDir", self.device_info_dir))
        seen: dict[str, str] = {}
        for name, where in self.served_names(pools_from):
            if name in seen:
                raise ValueError(f"resource {name} is configured twice: by {seen[name]} and by {where}")
            seen[name] = where
        self._check_gpu_serving()


@dataclass
class PodResourcesConfig:
    """The kubelet's PodResources API: which container holds which device."""

    socket: str = setting("/var/lib/kubelet/pod-resources/kubelet.sock", flag="--pod-resources-socket",
                          env="GPU_NODE_AGENT_POD_RESOURCES_SOCKET",
                          help="the kubelet's PodResources v1 socket (mount its directory, not the socket, so "
                               "the agent sees it again after a kubelet restart); \"\" turns its use off")
    poll_interval_seconds: float = setting(10.0, floor=0.1,
                                           help="seconds between reads of who holds which device (metrics, "
                                                      "free devices after a restart)")
    lookup_timeout_seconds: float = setting(
        0.05, flag="--pod-resources-lookup-timeout", env="GPU_NODE_AGENT_POD_RESOURCES_LOOKUP_TIMEOUT",
        help="seconds the PodResources lookup inside a GetPreferredAllocation call may take (token wait included); "
             "past it the agent answers with its own policy, and the late reply still becomes its reading. The "
             "default is about twice the lookup's p99 measured with both cores of a 2-core VM busy "
             "(bench/podresources_lookup.py)")

    def check(self) -> None:
        """An absolute socket path and positive intervals."""
        if self.socket and not self.socket.startswith("/"):
            raise ValueError(f"socket: {self.socket!r} must be an absolute path")
        if self.poll_interval_seconds <= 0 or self.lookup_timeout_seconds <= 0:
            raise ValueError("pollIntervalSeconds and lookupTimeoutSeconds must be positive")


@dataclass
class DraConfig:
    """The DRA driver: GPUs and RDMA functions as ResourceSlices, prepared for pods by the kubelet DRA plugin."""

    enabled: bool = setting(False, flag="--dra", env="GPU_NODE_AGENT_DRA",
                            help="publish GPUs and RDMA VFs through DRA (resource.k8s.io/v1, Kubernetes 1.34+); "
                                 "the device plugin then serves neither (see README, DRA)")
    driver_name: str = setting(PROJECT_DOMAIN, flag="--dra-driver-name", env="GPU_NODE_AGENT_DRA_DRIVER_NAME",
                               help="DRA driver name (ResourceSlice spec.driver, DeviceClass selectors)")
    plugin_registry_dir: str = setting(
        "/var/lib/kubelet/plugins_registry", flag="--plugin-registry-dir", env="GPU_NODE_AGENT_PLUGIN_REGISTRY_DIR",
        help="kubelet plugin-watcher directory (<driver>-reg.sock, and the device plugin's sockets with "
             "--registration-mode plugin-watcher)")
    plugin_dir: str = setting("", flag="--dra-plugin-dir", env="GPU_NODE_AGENT_DRA_PLUGIN_DIR",
                              help="directory of the DRA service socket dra.sock; /var/lib/kubelet/plugins/<driver> "
                                   "when empty")
    cdi_spec_dir: str = setting("/var/run/cdi", flag="--cdi-spec-dir", env="GPU_NODE_AGENT_CDI_SPEC_DIR",
                                help="CDI spec directory the container runtime reads (DRA claims, --rdma-cdi "
                                     "pools; GPU specs are looked for here too)")
    gpus: bool = setting(True, help="publish GPUs (off when NVIDIA's GPU driver or device plugin serves them)")
    rdma: bool = setting(True, help="publish RDMA functions")
    rdma_resource_name: str = setting(f"{PROJECT_DOMAIN}/sriov_rdma",
                                      help="k8s.cni.cncf.io/resourceName of RDMA devices: the NetworkAttachment"
                                           "Definition's resourceName annotation, for Multus")
    resync_seconds: float = setting(60.0, floor=1.0,
                                    help="republish slices this often (the kubelet wipes them at its start)")

    @property
    def socket_dir(self) -> str:
        """Where dra.sock lives."""
        return self.plugin_dir or f"/var/lib/kubelet/plugins/{self.driver_name}"

    def check(self) -> None:
        """The driver name is a DNS subdomain of at most 63 characters (ResourceSlice spec.driver); the node
        directories are absolute."""
        check_dirs(("pluginRegistryDir", self.plugin_registry_dir), ("cdiSpecDir", self.cdi_spec_dir), required=True)
        check_dirs(("pluginDir", self.plugin_dir))
        if len(self.driver_name) > 63 or not re.fullmatch(
                r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", self.driver_name):
            raise ValueError(f"driverName: {self.driver_name!r} is not a DNS subdomain of at most 63 characters")
        if self.resync_seconds <= 0:
            raise ValueError(f"resyncSeconds: {self.resync_seconds} must be positive")


@dataclass
class ApiServerConfig:
    """How the agent reaches the Kubernetes API server (shared by remediation and network accounting)."""

    kubeconfig: str | None = setting(None, flag="--kubeconfig", env="GPU_NODE_AGENT_KUBECONFIG",
                                     help="kubeconfig file; the in-cluster service account when unset")
    timeout_seconds: float = setting(10.0, flag="--api-timeout", env="GPU_NODE_AGENT_API_TIMEOUT",
                                     help="timeout of one API server request")

    def check(self) -> None:
        """A request timeout must be positive; the kubeconfig, when it exists, a regular file."""
        check_files(("kubeconfig", self.kubeconfig))
        if self.timeout_seconds <= 0:
            raise ValueError(f"timeoutSeconds: {self.timeout_seconds} must be positive")


@dataclass
class AgentConfig:
    """All settings of one agent process."""

    version: int = setting(CONFIG_VERSION, help="config schema version")
    node_name: str = setting("", flag="--node-name", env="NODE_NAME",
                             help="this node's Kubernetes name (downward API spec.nodeName)")
    state_dir: str = setting("/var/lib/gpu-node-agent", flag="--state-dir", env="GPU_NODE_AGENT_STATE_DIR",
                             help="directory for state that must survive restarts")
    log_level: str = setting("info", flag="--log-level", env="GPU_NODE_AGENT_LOG_LEVEL",
                             choices=("debug", "info", "warning", "error"), help="log level")
    log_format: str = setting("auto", flag="--log-format", env="GPU_NODE_AGENT_LOG_FORMAT",
                              choices=("auto", "json", "text"),
                              help="json lines, plain text, or auto (text on a terminal, json otherwise)")
    metrics_address: str = setting(":10437", flag="--metrics-address", env="GPU_NODE_AGENT_METRICS_ADDRESS",
                                   help="host:port for /metrics, /healthz and /readyz (port 0 picks a free one)")
    topology: TopologyConfig = setting(factory=TopologyConfig, help="hardware model sources")
    device_plugin: DevicePluginConfig = setting(factory=DevicePluginConfig, help="kubelet device plugin")
    api_server: ApiServerConfig = setting(factory=ApiServerConfig, help="Kubernetes API server access")
    pod_resources: PodResourcesConfig = setting(factory=PodResourcesConfig,
                                                help="kubelet PodResources API (device ownership)")
    dra: DraConfig = setting(factory=DraConfig, help="DRA driver (ResourceSlices, kubelet DRA plugin)")
    health: HealthConfig = setting(factory=HealthConfig, help="GPU and NIC health checks")
    remediation: RemediationConfig = setting(factory=RemediationConfig, help="actions on this node's API objects")
    netacct: NetacctConfig = setting(factory=NetacctConfig, help="network traffic accounting")
    shaping: ShapingConfig = setting(factory=ShapingConfig, help="per-pod internet bandwidth shaping")
    node_labels: NodeLabelsConfig = setting(factory=NodeLabelsConfig,
                                            help="node labels for schedulers (NFD NodeFeature or the Node)")


    def check(self) -> None:
        """Cross-field checks (the loader reports them as exit code 2)."""
        if self.version != CONFIG_VERSION:
            raise ValueError(f"version: {self.version} is not a config version this agent reads "
                             f"(it reads version {CONFIG_VERSION})")
        parse_address(self.metrics_address)
        check_dirs(("stateDir", self.state_dir), required=True)
        if self.node_name:
            try:
                check_node_name(self.node_name)
            except ValueError as exc:
                raise ValueError(f"nodeName (--node-name, NODE_NAME): {exc}") from None
        self._resolve_sentinel_dir()

    def _resolve_sentinel_dir(self) -> None:
        """The reboot sentinel's allowed directory: rebootSentinelDir, else stateDir (filled in here, so the
        remediation subsystem and `config --dump` see the directory in force)."""
        rem = self.remediation
        if not rem.reboot_sentinel_path:
            return
        if not rem.reboot_sentinel_dir:
            rem.reboot_sentinel_dir = self.state_dir.rstrip("/") or "/"
        try:
            check_sentinel_path(rem.reboot_sentinel_path, rem.reboot_sentinel_dir)
        except ValueError as exc:
            raise ValueError(f"remediation.{exc}") from None
