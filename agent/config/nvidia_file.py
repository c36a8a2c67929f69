"""NVIDIA k8s-device-plugin's config file (`--config-file`, `CONFIG_FILE`; api/config/v1) as a layer of settings.

An operator replacing NVIDIA's plugin hands over its ConfigMap as it is. Read as NVIDIA reads it
(api/config/v1 `parseConfigFrom`, `ReplicatedResources.UnmarshalJSON`), and what NVIDIA's device plugin then
does with it (cmd/nvidia-device-plugin/main.go calls `DisableResourceNamingInConfig`):

- `version`: `v1` (empty means v1); anything else is refused (`unknown version`);
- `flags`: each value goes through `nvidia_env` under NVIDIA's environment name of the same flag, so the file and
  the environment agree on what is honoured, ignored (with a warning) or refused; `flags.gfd` is dropped, as
  NVIDIA's plugin drops it;
- `sharing.timeSlicing` becomes `devicePlugin.timeSlicing`, checked as NVIDIA checks it (`resources` present and
  non-empty, a `name`, `replicas` >= 2, `devices` as `all`, a count > 0 or a list of GPU/MIG indices and UUIDs);
  then, as NVIDIA's plugin, `rename` and `devices` are ignored with NVIDIA's warnings (renameByDefault alone
  renames, to `<name>.shared`; every device is replicated);
- `sharing.mps` is refused: MPS needs NVIDIA's MPS control daemon, which the agent does not drive;
- `resources` is ignored with NVIDIA's warning; `imex` other than empty is refused, as the IMEX_* variables are.

Precedence is NVIDIA's: the file is below everything else (its plugin: flags > environment > file), so the
agent's config file, environment and flags all win over it. The result is plain data for `agent.config.load`.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.config import nvidia_env

log = logging.getLogger(__name__)

VERSION = "v1"
PREFIX = "nvidia.com"  # NVIDIA's ResourceNamePrefix: a name without it gets it
MAX_NAME = 63  # NVIDIA's MaxResourceNameLength, of the full name
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# flags key path -> NVIDIA's environment variable of that flag (cmd/nvidia-device-plugin/main.go)
FLAG_ENV: Mapping[tuple[str, ...], str] = {
    ("migStrategy",): "MIG_STRATEGY",
    ("failOnInitError",): "FAIL_ON_INIT_ERROR",
    ("mpsRoot",): "MPS_ROOT",
    ("nvidiaDriverRoot",): "NVIDIA_DRIVER_ROOT",
    ("nvidiaDevRoot",): "NVIDIA_DEV_ROOT",
    ("gdrcopyEnabled",): "GDRCOPY_ENABLED",
    ("gdsEnabled",): "GDS_ENABLED",
    ("mofedEnabled",): "MOFED_ENABLED",
    ("useNodeFeatureAPI",): "USE_NODE_FEATURE_API",
    ("deviceDiscoveryStrategy",): "DEVICE_DISCOVERY_STRATEGY",
    ("plugin", "passDeviceSpecs"): "PASS_DEVICE_SPECS",
    ("plugin", "deviceListStrategy"): "DEVICE_LIST_STRATEGY",
    ("plugin", "deviceIDStrategy"): "DEVICE_ID_STRATEGY",
    ("plugin", "cdiAnnotationPrefix"): "CDI_ANNOTATION_PREFIX",
    ("plugin", "nvidiaCTKPath"): "NVIDIA_CTK_PATH",
    ("plugin", "containerDriverRoot"): "CONTAINER_DRIVER_ROOT",
    ("plugin", "sharedDevicesAllocationPolicy"): "SHARED_DEVICES_ALLOCATION_POLICY",
}
_SECTIONS = ("version", "flags", "resources", "sharing", "imex")
_INDEX = re.compile(r"^[0-9]{1,9}(:[0-9]{1,9})?$")  # a GPU index, or a MIG index <gpu>:<mig>


class NvidiaConfigError(ValueError):
    """NVIDIA's config file cannot be read as NVIDIA reads it, or asks for what the agent does not serve."""


@dataclass(frozen=True)
class NvidiaLayer:
    """What the file sets: the agent's environment names -> values, and `devicePlugin.timeSlicing` (or None)."""

    env: dict[str, str]
    time_slicing: dict[str, Any] | None


def translate(data: Mapping[str, Any], source: str) -> NvidiaLayer:
    """The settings NVIDIA's parsed config file `data` (read from `source`) gives; NvidiaConfigError otherwise."""
    version = data.get("version") or VERSION
    if version != VERSION:
        raise NvidiaConfigError(f"unknown version: {str(version)[:40]} (NVIDIA's config format is version: v1)")
    for key in data:
        if key not in _SECTIONS:
            log.warning("%s: %r is not a section of NVIDIA's config (v1); ignored", source, str(key)[:40])
    if _mapping(data, "resources", "resources"):
        log.warning("%s: customizing the 'resources' field is not yet supported in the config (NVIDIA's plugin "
                    "ignores it too); ignored", source)
    _check_imex(_mapping(data, "imex", "imex"))
    env = _flag_env(_mapping(data, "flags", "flags"), source)
    try:
        translated = nvidia_env.translate(env, source=source)
    except nvidia_env.NvidiaEnvError as exc:
        raise NvidiaConfigError(f"flags: {exc}") from None
    ours = {name: value for name, value in translated.items() if name.startswith("GPU_NODE_AGENT_")}
    sharing = _mapping(data, "sharing", "sharing")
    if sharing.get("mps") is not None:
        raise NvidiaConfigError("sharing.mps: MPS sharing is not supported by gpu-node-agent (it needs NVIDIA's MPS "
                                "control daemon); remove it or keep NVIDIA's plugin on this node")
    for key in sharing:
        if key not in ("mps", "timeSlicing"):
            log.warning("%s: sharing.%s is not a sharing strategy of NVIDIA's config; ignored", source, str(key)[:40])
    sliced = sharing.get("timeSlicing")
    return NvidiaLayer(env=ours, time_slicing=None if sliced is None else _time_slicing(sliced, source))


def _mapping(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise NvidiaConfigError(f"{where}: expected a mapping, got {_shown(value)}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_imex(imex: Mapping[str, Any]) -> None:
    ids, required = imex.get("channelIDs") or [], imex.get("required") or False
    if ids or required:
        raise NvidiaConfigError(f"imex: IMEX channels (channelIDs {_shown(ids)}, required {_shown(required)}) are "
                                "not supported by gpu-node-agent; remove them or keep NVIDIA's plugin on this node")


def _flag_env(flags: Mapping[str, Any], source: str) -> dict[str, str]:
    """NVIDIA's environment name -> the value as its environment would spell it."""
    env: dict[str, str] = {}
    plugin = _mapping(flags, "plugin", "flags.plugin")
    known = {path[-1] for path in FLAG_ENV if len(path) == 1} | {"plugin", "gfd"}
    unknown = [f"flags.{k}" for k in flags if k not in known] + \
              [f"flags.plugin.{k}" for k in plugin if k not in {p[-1] for p in FLAG_ENV if len(p) == 2}]
    for name in unknown:
        log.warning("%s: %s is not one of NVIDIA's flags; ignored", source, name[:60])
    for path, name in FLAG_ENV.items():
        value = (plugin if len(path) == 2 else flags).get(path[-1])
        if value is None:  # unset (NVIDIA's nil pointer)
            continue
        where = "flags." + ".".join(path)
        if isinstance(value, bool):
            env[name] = "true" if value else "false"
        elif isinstance(value, str):
            env[name] = value
        elif isinstance(value, list) and path[-1] == "deviceListStrategy" and all(isinstance(v, str) for v in value):
            env[name] = ",".join(value)
        else:
            raise NvidiaConfigError(f"{where}: expected a string or true/false, got {_shown(value)}")
    return env


def resource_name(value: object, where: str) -> str:
    """NVIDIA's `NewResourceName`: `nvidia.com/` added when missing, 63 characters at most, a DNS-subdomain name."""
    if not isinstance(value, str):
        raise NvidiaConfigError(f"{where}: expected a resource name, got {_shown(value)}")
    full = value if value.startswith(PREFIX + "/") else f"{PREFIX}/{value}"
    if len(full) > MAX_NAME:
        raise NvidiaConfigError(f"{where}: fully-qualified resource name must be {MAX_NAME} characters or less: "
                                f"{_shown(full)}")
    if not _DNS_SUBDOMAIN.match(full.split("/", 1)[1]):
        raise NvidiaConfigError(f"{where}: incorrect format for resource name {_shown(full)}: a lowercase DNS "
                                "subdomain is required")
    return full


def _time_slicing(sliced: object, source: str) -> dict[str, Any]:
    where = "sharing.timeSlicing"
    if not isinstance(sliced, Mapping):
        raise NvidiaConfigError(f"{where}: expected a mapping, got {_shown(sliced)}")
    flags = {}
    for key in ("renameByDefault", "failRequestsGreaterThanOne"):
        value = sliced.get(key, False)
        if not isinstance(value, bool):
            raise NvidiaConfigError(f"{where}.{key}: expected true or false, got {_shown(value)}")
        flags[key] = value
    entries = sliced.get("resources")
    if not isinstance(entries, list) or not entries:
        raise NvidiaConfigError(f"{where}.resources: no resources specified")
    resources: list[dict[str, Any]] = []
    named: set[str] = set()
    for i, entry in enumerate(entries):  # a repeat is refused at once (YAML aliases make 19,000 entries cheap)
        resource = _resource(entry, f"{where}.resources[{i}]", flags["renameByDefault"], source)
        if resource["name"] in named:
            raise NvidiaConfigError(f"{where}.resources[{i}]: {resource['name']} is listed twice")
        named.add(resource["name"])
        resources.append(resource)
    return {**flags, "resources": resources}


def _resource(entry: object, where: str, rename_by_default: bool, source: str) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        raise NvidiaConfigError(f"{where}: expected a mapping, got {_shown(entry)}")
    if "name" not in entry:
        raise NvidiaConfigError(f"{where}: no resource name specified")
    name = resource_name(entry["name"], f"{where}.name")
    _devices(entry.get("devices", "all"), f"{where}.devices", name, source)
    if "replicas" not in entry:
        raise NvidiaConfigError(f"{where}: no replicas specified")
    replicas = entry["replicas"]
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise NvidiaConfigError(f"{where}.replicas: expected an integer, got {_shown(replicas)}")
    if replicas < 2:
        raise NvidiaConfigError(f"{where}.replicas: number of replicas must be >= 2, got {replicas}")
    if entry.get("rename") is not None:
        rename = resource_name(entry["rename"], f"{where}.rename")
        if rename != (name + ".shared" if rename_by_default else ""):
            log.warning("%s: setting the 'rename' field in sharing.timeSlicing.resources is not yet supported in "
                        "the config (NVIDIA's plugin ignores it too); %s is served as %s", source, name,
                        name + ".shared" if rename_by_default else name)
    return {"name": name, "replicas": replicas}


def _devices(value: object, where: str, name: str, source: str) -> None:
    """Check `devices` as NVIDIA's `ReplicatedDevices.UnmarshalJSON`; anything but `all` is then ignored, as there."""
    if value == "all":
        return
    if isinstance(value, str):
        raise NvidiaConfigError(f"{where}: devices set as {_shown(value)} but the only valid string input is 'all'")
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise NvidiaConfigError(f"{where}: devices set as {value} but a count of devices must be > 0")
    elif isinstance(value, list):
        for item in value:
            if not _device_ref(item):
                raise NvidiaConfigError(f"{where}: unsupported type for device in devices list: {_shown(item)} "
                                        "(a GPU index, a MIG index <gpu>:<mig>, or a GPU or MIG UUID)")
    else:
        raise NvidiaConfigError(f"{where}: unrecognized type for devices spec: {_shown(value)}")
    log.warning("%s: customizing the 'devices' field in sharing.timeSlicing.resources is not yet supported in the "
                "config (NVIDIA's plugin ignores it too); every device of %s is replicated", source, name)


def _device_ref(item: object) -> bool:
    """A GPU index, a MIG index (`<gpu>:<mig>`), a GPU UUID or a MIG UUID (api/config/v1/replicas.go)."""
    if isinstance(item, int) and not isinstance(item, bool):
        return item >= 0
    if not isinstance(item, str) or len(item) > 80:
        return False
    return bool(_INDEX.match(item)) or _gpu_uuid(item) or _mig_uuid(item)


def _uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _gpu_uuid(text: str) -> bool:
    return text.startswith("GPU-") and _uuid(text[4:])


def _mig_uuid(text: str) -> bool:
    """`MIG-<uuid>` or the older `MIG-GPU-<uuid>/<gi>/<ci>`."""
    if not text.startswith("MIG-"):
        return False
    rest = text[4:]
    if _uuid(rest):
        return True
    parts = rest.split("/")
    return len(parts) == 3 and _gpu_uuid(parts[0]) and all(_INDEX.match(part) and ":" not in part
                                                           for part in parts[1:])
