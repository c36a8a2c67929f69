"""Read the SR-IOV network device plugin's `config.json` into the agent's own pool config.

An operator replacing `sriov-network-device-plugin` keeps its ConfigMap: `--sriov-dp-config FILE` turns each
`resourceList` entry into a `PoolConfig` with the same resource name and the same devices, so pods and
NetworkAttachmentDefinitions that name `intel.com/…` or `nvidia.com/…` resources keep working.

Keys keep the SR-IOV plugin's meaning (k8snetworkplumbingwg/sriov-network-device-plugin:pkg/types/types.go,
pkg/netdevice/netDeviceProvider.go, README "Config parameters"):

- no `resourcePrefix` means the plugin's `-resource-prefix`: `intel.com` by default, or the agent's
  `--resource-prefix` when it is set to anything but the agent's own default (the SR-IOV Network Operator runs the
  plugin with `-resource-prefix=<its prefix>`, so a migration keeps every resource name);
- `selectors` is one object or a list of objects; a device joins a pool when any object matches, and the first
  pool in file order that claims it;
- `isRdma: true` keeps RDMA functions only; `false` is no filter (not "non-RDMA only");
- keys are matched case-insensitively, as Go's encoding/json does (`"IsRdma"` in the plugin's own per-node
  example works there and here).

What the agent cannot honour is never dropped silently: a key that would narrow a pool (`ddpProfiles`, `pKeys`,
`acpiIndexes`, `vdpaType`, `needVhostNet: true`) or a `deviceType` other than `netDevice` is an error that names
the pool and the key (serving a wider pool than configured would hand out wrong devices); a key that changes no
device set (`additionalInfo`, unknown keys the plugin itself ignores) is a warning. A VF range that cannot be
read (`#5-2`, `#0-x`) is an error too: it would match nothing.

The file comes from outside and is bounded while it is read: at most `MAX_FILE_BYTES` (a ConfigMap holds at
most 1 MiB), UTF-8, nested at most `MAX_DEPTH` levels, integers of at most 40 digits, no NaN/Infinity, at most
`MAX_RESOURCES` resources, `MAX_SELECTOR_OBJECTS` selector objects per resource and `MAX_LIST` entries per
selector list. Anything past a bound is a `SriovConfigError` (exit 2), never a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from agent.config.bounded_parse import MAX_DEPTH, nesting_depth
from agent.config.files import read_regular
from agent.config.model import DEFAULT_RESOURCE_PREFIX, DevicePluginConfig, PoolConfig, SelectorConfig
from agent.config.numbers import NumberError, bounded_float, bounded_int, no_constant
from agent.deviceplugin.pools import PoolConfigError, check_resource_name

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "intel.com"  # sriov-network-device-plugin's -resource-prefix default
NET_DEVICE = "netdevice"  # deviceType, compared lower-case
MAX_FILE_BYTES = 1 << 20  # a ConfigMap (the file's source) holds at most 1 MiB
MAX_RESOURCES = 256  # resources in one file; a node serves a handful
MAX_SELECTOR_OBJECTS = 64  # selector objects of one resource
MAX_LIST = 1024  # entries of one selector list (vendors, pfNames, pciAddresses, ...)

# selector key (lower case) -> SelectorConfig field, for the selectors the agent applies itself
_LIST_SELECTORS = {
    "vendors": "vendors",
    "devices": "devices",
    "drivers": "drivers",
    "pciaddresses": "pci_addresses",
    "pfnames": "pf_names",
    "rootdevices": "root_devices",
    "linktypes": "link_types",
}
# selectors that narrow a pool in the SR-IOV plugin and that the agent cannot evaluate
_UNSUPPORTED_SELECTORS = {
    "acpiindexes": "acpiIndexes",
    "ddpprofiles": "ddpProfiles",
    "pkeys": "pKeys",
    "vdpatype": "vdpaType",
    "auxtypes": "auxTypes",
}
_RESOURCE_KEYS = {"resourcename", "resourceprefix", "devicetype", "excludetopology", "selectors",
                  "additionalinfo", "selectorobjs"}


class SriovConfigError(PoolConfigError):
    """The SR-IOV device plugin config cannot be served as written; the message names the file and the key."""


@dataclass(frozen=True)
class SriovConfig:
    """The pools read from one config.json, and what was ignored (each also logged once as a warning)."""

    pools: tuple[PoolConfig, ...]
    warnings: tuple[str, ...] = ()


def _lower_keys(data: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """lower-case key -> (key as written, value); Go's decoder matches keys case-insensitively."""
    return {str(key).lower(): (str(key), value) for key, value in data.items()}


class _Reader:
    def __init__(self, path: str, default_prefix: str) -> None:
        self.path = path
        self.default_prefix = default_prefix
        self.warnings: list[str] = []

    def error(self, where: str, message: str) -> SriovConfigError:
        return SriovConfigError(f"SR-IOV device plugin config {self.path}: {where}: {message}")

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(f"{where}: {message}")

    def string_list(self, value: Any, where: str) -> list[str]:
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.error(where, f"expected a list of strings, got {json.dumps(value)[:80]}")
        if len(value) > MAX_LIST:
            raise self.error(where, f"{len(value)} entries, more than any selector needs ({MAX_LIST})")
        return list(value)

    def boolean(self, value: Any, where: str) -> bool:
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.error(where, f"expected true or false, got {json.dumps(value)[:40]}")
        return value

    def selector(self, data: Any, where: str) -> SelectorConfig:
        if not isinstance(data, Mapping):
            raise self.error(where, f"a selector object must be a JSON object, got {json.dumps(data)[:80]}")
        fields: dict[str, Any] = {}
        for key, (written, value) in _lower_keys(data).items():
            at = f"{where}.{written}"
            if key in _LIST_SELECTORS:
                fields[_LIST_SELECTORS[key]] = self.string_list(value, at)
            elif key == "isrdma":
                # true: RDMA functions only; false: no filter, exactly as in the SR-IOV plugin
                fields["is_rdma"] = True if self.boolean(value, at) else None
            elif key == "needvhostnet":
                if self.boolean(value, at):
                    raise self.error(at, "vhost-net devices are not served by gpu-node-agent; keep this pool on "
                                         "the SR-IOV device plugin or remove needVhostNet")
            elif key in _UNSUPPORTED_SELECTORS:
                if value not in (None, [], ""):
                    raise self.error(at, f"selector {_UNSUPPORTED_SELECTORS[key]} is not supported by "
                                         "gpu-node-agent; without it the pool would take devices it should not. "
                                         "Remove it or keep this pool on the SR-IOV device plugin")
            else:
                self.warn(at, "unknown selector, ignored (the SR-IOV device plugin ignores it too)")
        selector = SelectorConfig(**fields)
        try:
            selector.check()  # a VF range that cannot be read would match nothing: refused, not dropped
        except ValueError as exc:
            raise self.error(where, str(exc)) from None
        return selector

    def selectors(self, value: Any, where: str) -> list[SelectorConfig]:
        if isinstance(value, list):
            if len(value) > MAX_SELECTOR_OBJECTS:
                raise self.error(where, f"{len(value)} selector objects, more than any pool needs "
                                        f"({MAX_SELECTOR_OBJECTS})")
            return [self.selector(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return [self.selector(value, where)]

    def resource(self, data: Any, index: int) -> PoolConfig | None:
        where = f"resourceList[{index}]"
        if not isinstance(data, Mapping):
            raise self.error(where, f"expected an object, got {json.dumps(data)[:80]}")
        keys = _lower_keys(data)
        name = keys.get("resourcename", ("", None))[1]
        if not isinstance(name, str) or not name:
            raise self.error(where, "resourceName is required")
        where = f"{where} ({name})"
        prefix = keys.get("resourceprefix", ("", None))[1] or self.default_prefix
        if not isinstance(prefix, str):
            raise self.error(where, f"resourcePrefix must be a string, got {json.dumps(prefix)}")
        try:
            check_resource_name(prefix, name)
        except PoolConfigError as exc:
            raise self.error(where, str(exc)) from None
        device_type = keys.get("devicetype", ("", None))[1] or "netDevice"
        if str(device_type).lower() != NET_DEVICE:
            raise self.error(where, f"deviceType {device_type!r} is not served by gpu-node-agent (only "
                                    "netDevice); keep this pool on the SR-IOV device plugin or remove it")
        for key, (written, value) in keys.items():
            if key == "additionalinfo" and value:
                self.warn(f"{where}.{written}", "not supported: the PCIDEVICE_…_INFO variable carries no "
                                                "extraInfo")
            elif key == "isrdma":
                self.warn(f"{where}.{written}", "isRdma belongs inside selectors; at the resource level the "
                                                "SR-IOV device plugin ignores it, and so does the agent")
            elif key not in _RESOURCE_KEYS:
                self.warn(f"{where}.{written}", "unknown key, ignored (the SR-IOV device plugin ignores it too)")
        raw_selectors = keys.get("selectors", ("", None))[1]
        if raw_selectors is None or raw_selectors == []:
            self.warn(where, "no selectors: the SR-IOV device plugin serves no devices for it; not served")
            return None
        first, *more = self.selectors(raw_selectors, f"{where}.selectors")
        return PoolConfig(resource_name=name, resource_prefix=prefix, selectors=first, selector_list=more,
                          exclude_topology=self.boolean(keys.get("excludetopology", ("", None))[1],
                                                        f"{where}.excludeTopology"))

    def parse(self) -> Any:
        """The file's JSON, read within the bounds (size before reading, UTF-8, depth, numbers)."""
        where = f"SR-IOV device plugin config {self.path}"
        try:
            raw = read_regular(self.path, MAX_FILE_BYTES)  # never waits on a FIFO
        except OSError as exc:
            raise SriovConfigError(f"{where}: cannot read: {exc.strerror or exc}") from exc
        if len(raw) > MAX_FILE_BYTES:
            raise SriovConfigError(f"{where}: larger than {MAX_FILE_BYTES} bytes (a ConfigMap holds at most 1 MiB)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SriovConfigError(f"{where}: not UTF-8 text (byte {exc.start})") from None
        try:
            data = json.loads(text, parse_int=bounded_int, parse_float=bounded_float, parse_constant=no_constant)
        except json.JSONDecodeError as exc:
            raise SriovConfigError(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column "
                                   f"{exc.colno}") from None
        except RecursionError:
            raise SriovConfigError(f"{where}: nested more deeply than any config ({MAX_DEPTH} levels)") from None
        except NumberError as exc:
            raise SriovConfigError(f"{where}: {exc}") from None
        except (ValueError, ArithmeticError) as exc:  # defensive: no number may end in a traceback
            raise SriovConfigError(f"{where}: a value cannot be read: {str(exc)[:120]}") from None
        if nesting_depth(data) > MAX_DEPTH:
            raise SriovConfigError(f"{where}: nested more deeply than any config ({MAX_DEPTH} levels)")
        return data

    def read(self) -> SriovConfig:
        data = self.parse()
        if not isinstance(data, Mapping):
            raise self.error("top level", "expected an object with resourceList")
        keys = _lower_keys(data)
        for key, (written, _) in keys.items():
            if key != "resourcelist":
                self.warn(written, "unknown key, ignored")
        resources = keys.get("resourcelist", ("", None))[1]
        if not isinstance(resources, list):
            raise self.error("resourceList", "required, a list of resource objects")
        if len(resources) > MAX_RESOURCES:
            raise self.error("resourceList", f"{len(resources)} resources, more than one node serves "
                                             f"({MAX_RESOURCES})")
        pools: list[PoolConfig] = []
        problems: list[str] = []  # every refused pool in one run, not one per run
        for i, item in enumerate(resources):
            try:
                pool = self.resource(item, i)
            except SriovConfigError as exc:
                problems.append(str(exc))
                continue
            if pool is not None:
                pools.append(pool)
        seen: set[str] = set()
        for pool in pools:
            full = f"{pool.resource_prefix}/{pool.resource_name}"
            if full in seen:
                problems.append(str(self.error("resourceList", f"resource {full} is configured twice")))
            seen.add(full)
        if problems:
            more = f" ({len(problems)} problems)" if len(problems) > 1 else ""
            raise SriovConfigError("\n".join(problems) + more)
        return SriovConfig(pools=tuple(pools), warnings=tuple(self.warnings))


def default_prefix(config: DevicePluginConfig) -> str:
    """The prefix of a pool without `resourcePrefix`: `--resource-prefix` when set to anything but the agent's
    default (the SR-IOV plugin's own `-resource-prefix`), else the SR-IOV plugin's default, intel.com."""
    return config.resource_prefix if config.resource_prefix != DEFAULT_RESOURCE_PREFIX else DEFAULT_PREFIX


def read_config(path: str, prefix: str = DEFAULT_PREFIX) -> SriovConfig:
    """Parse and check one SR-IOV device plugin config.json; `prefix` for pools that name none. Raises
    SriovConfigError naming file and key of every pool that cannot be served."""
    return _Reader(path, prefix).read()


def apply(config: DevicePluginConfig) -> DevicePluginConfig:
    """The device-plugin config with `pools` replaced by the SR-IOV file's pools when `sriov_dp_config` is set.

    Warnings are logged here, once, naming the file.
    """
    if not config.sriov_dp_config:
        return config
    read = read_config(config.sriov_dp_config, default_prefix(config))
    served = with_pools(config, read)
    for warning in read.warnings:
        log.warning("SR-IOV device plugin config %s: %s", config.sriov_dp_config, warning)
    log.info("SR-IOV device plugin config %s: serving %d pools from it: %s", config.sriov_dp_config,
             len(read.pools), ", ".join(f"{p.resource_prefix}/{p.resource_name}" for p in read.pools))
    return served


def with_pools(config: DevicePluginConfig, read: SriovConfig) -> DevicePluginConfig:
    """`config` serving the file's pools instead of `pools`, checked as the config loader checks `pools`: a pool
    whose full name another served resource has (the GPUs' `nvidia.com/gpu`) is a SriovConfigError naming both,
    at load, instead of a device plugin that crash-loops on it."""
    served = replace(config, pools=list(read.pools))
    try:
        served.check(pools_from=f"SR-IOV device plugin config {config.sriov_dp_config}")
    except ValueError as exc:
        raise SriovConfigError(str(exc)) from None
    return served
