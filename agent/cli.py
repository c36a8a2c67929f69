"""Command line: `gpu-node-agent run | doctor | fleet | topology | simulate-node | simulate-dcgm-exporter | config`.

Flags and environment are parsed here, once, into an `AgentConfig` that is passed down; nothing below reads
`os.environ`. Bad configuration or input exits with code 2 and a message naming what is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from agent import __version__, config
from agent.logs import setup_logging

if TYPE_CHECKING:
    from agent.deviceplugin.sriovdp import SriovConfig
    from agent.node import Node

log = logging.getLogger("agent")

EXIT_USAGE = 2


class UsageError(Exception):
    """Invalid configuration or input; reported on stderr with exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-node-agent",
        description="GPU node agent: device plugin with PCIe-aware GPU+NIC allocation, health, remediation, "
                    "network accounting.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the agent (device plugin and the other enabled subsystems)",
                         description="Run the agent. Every setting can also come from the config file "
                                     "(--config) or the environment variable named in its help.")
    config.add_flags(run)

    topo = sub.add_parser("topology", help="print the GPU/NIC PCIe distance matrix (like nvidia-smi topo -m)")
    config.add_flags(topo, sections=("topology",))
    topo.add_argument("--json", action="store_true", help="print JSON instead of the matrix")

    sim = sub.add_parser("simulate-node", help="write a built-in simulated node as a sysfs tree")
    sim.add_argument("--profile", help="profile name (see --list)")
    sim.add_argument("--out", type=Path, help="directory to write the sysfs tree into (it plays /sys)")
    sim.add_argument("--list", action="store_true", help="list the built-in profiles")

    dcgm = sub.add_parser("simulate-dcgm-exporter", help="serve a simulated dcgm-exporter /metrics for a profile")
    dcgm.add_argument("--profile", required=True, help="profile name (see simulate-node --list)")
    dcgm.add_argument("--address", default="127.0.0.1:9410", help="HOST:PORT to listen on (default %(default)s)")
    dcgm.add_argument("--xid-metrics", default="gauge",
                      help="comma-separated Xid metrics to export: gauge, count, total (default %(default)s)")
    dcgm.add_argument("--hostname", help="Hostname label (default: this host's name)")

    net = sub.add_parser("netacct", help="network accounting maintenance")
    net_sub = net.add_subparsers(dest="netacct_command", required=True, metavar="ACTION")
    clean = net_sub.add_parser("cleanup", help="remove every chain, rule and set netacct installed, nothing else (stop "
                                               "the agent first; shaping's objects: `shaping cleanup`)")
    config.add_flags(clean, sections=("netacct",))

    shp = sub.add_parser("shaping", help="pod internet shaping maintenance")
    shp_sub = shp.add_subparsers(dest="shaping_command", required=True, metavar="ACTION")
    shp_sub.add_parser("cleanup", help="remove every qdisc, filter and IFB shaping installed, nothing else "
                                       "(stop the agent first)")

    excl = sub.add_parser("dropin-exclusion",
                          help="print a JSON patch that keeps an old device plugin's DaemonSet (kubectl get -o json on "
                               "stdin) off nodes labelled gpunodeagent.io/drop-in=true, keeping its own affinity")
    excl.add_argument("--label", default="gpunodeagent.io/drop-in", help="the node label (value true) to exclude")
    doc = sub.add_parser("doctor", help="check once, read-only, what the agent can see on this node and why not",
                         description="Run every probe `run` uses once, read-only and bounded (under 10 s), with the "
                                     "same flags and config as `run`, and print one row per check: ok, warn, fail "
                                     "or skip, what was found, and the fix. Exit 0 when no check fails, 1 when "
                                     "one does, 2 on bad flags.")
    config.add_flags(doc)
    doc.add_argument("--json", action="store_true",
                     help='print {"checks": [{"name", "status", "detail", "fix"}, ...]} instead of the table')
    fleet = sub.add_parser("fleet", help="every node's GPU verdict, cordons, latches, GPU counts and repeat offenders, "
                                         "from one read-only paginated LIST of Nodes",
                           description="List every Node (pages of 500, read-only) and report what the agents wrote "
                                       "on them: nodes per verdict, cordoned by the agent, latched, GPUs expected "
                                       "and healthy fleet-wide, and the repeat offenders. Exit 0, 1 when the API "
                                       "server cannot be read, 2 on bad flags or a selector the server refuses.")
    config.add_flags(fleet, sections=("api_server",))
    fleet.add_argument("--json", action="store_true", help='print {"summary": {...}, "nodes": [...]}')
    fleet.add_argument("--selector", default="", metavar="LABELSELECTOR",
                       help="only nodes matching this label selector (sent to the API server as labelSelector)")
    fleet.add_argument("--repeat", default="3", metavar="N",
                       help="a repeat offender has at least N incidents inside its window (default %(default)s)")
    dump = sub.add_parser("config", help="print the effective configuration as YAML")
    dump.add_argument("--actions", action="store_true",
                      help="print the effective action table instead (every Xid and check, defaults + overrides)")
    dump.add_argument("--pools", action="store_true",
                      help="print which devices each pool takes on this node (the sysfs tree of --sysfs-root, or "
                           "--simulate), and the devices left out with why")
    config.add_flags(dump)
    return parser


def _load_config(args: argparse.Namespace) -> config.AgentConfig:
    try:
        cfg = config.load(args, os.environ)
    except config.ConfigError as exc:
        raise UsageError(f"invalid configuration: {exc}") from exc
    return cfg


@contextlib.contextmanager
def _opened_node(cfg: config.AgentConfig, prefix: str) -> Iterator[Node]:
    """The node as `run` opens it (`agent.node`), in a scratch directory removed afterwards."""
    from agent.node import open_node

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield open_node(cfg, Path(tmp))


def _cmd_topology(args: argparse.Namespace) -> int:
    from agent.topology.render import to_json, to_matrix

    with _opened_node(_load_config(args), "gna-sysfs-") as node:
        topology = node.hardware.topology
    print(json.dumps(to_json(topology), indent=2) if args.json else to_matrix(topology))
    return 0


def _cmd_simulate_node(args: argparse.Namespace) -> int:
    from agent.simulate import profiles, sysfs_writer

    if args.list:
        for name in profiles.list_profiles():
            print(f"{name}: {profiles.load_profile(name).description}")
        return 0
    if not args.profile or not args.out:
        raise UsageError("simulate-node needs --profile NAME and --out DIR (or --list)")
    profile = profiles.load_profile(args.profile)
    args.out.mkdir(parents=True, exist_ok=True)
    sysfs_writer.write_sysfs(profile, args.out)
    print(f"wrote simulated node {profile.name!r} to {args.out}"
          + (f"; its NCCL topology file is {profile.topology_xml}" if profile.topology_xml else ""))
    return 0


def _cmd_simulate_dcgm_exporter(args: argparse.Namespace) -> int:
    import signal
    import socket
    import threading

    from agent.config.address import parse_address
    from agent.simulate.dcgm_exporter import DcgmExporterServer, SimulatedDcgmExporter

    try:
        host, port = parse_address(args.address)
        exporter = SimulatedDcgmExporter.for_profile(args.profile, hostname=args.hostname or socket.gethostname(),
                                                     xid_metrics=[m.strip() for m in args.xid_metrics.split(",")])
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    server = DcgmExporterServer(exporter, host, port)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            url = server.start()
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.address}: {exc}") from exc
        print(f"simulated dcgm-exporter for {args.profile!r} serving {url}")
        print(f"inject an Xid: curl -X POST '{url.removesuffix('/metrics')}/inject?gpu=2&xid=79'", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
    return 0


def _read_sriov_dp_config(cfg: config.AgentConfig) -> SriovConfig | None:
    """The SR-IOV device plugin config file's pools when one is set; UsageError (exit 2) when it cannot be served."""
    from agent.deviceplugin import sriovdp

    if not cfg.device_plugin.sriov_dp_config:
        return None
    try:
        read = sriovdp.read_config(cfg.device_plugin.sriov_dp_config, sriovdp.default_prefix(cfg.device_plugin))
        sriovdp.with_pools(cfg.device_plugin, read)  # a name another served resource has: exit 2 here
        return read
    except sriovdp.SriovConfigError as exc:
        raise UsageError(str(exc)) from exc


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    plugin = cfg.device_plugin
    read = _read_sriov_dp_config(cfg)
    if read is not None:  # show the pools the SR-IOV file gives, and what in it the agent cannot honour
        for warning in read.warnings:
            print(f"gpu-node-agent config: warning: {plugin.sriov_dp_config}: {warning}", file=sys.stderr)
        cfg = dataclasses.replace(cfg, device_plugin=dataclasses.replace(plugin, pools=list(read.pools)))
    if getattr(args, "actions", False):
        print(yaml.safe_dump(_action_table(cfg), sort_keys=False), end="")
        return 0
    if getattr(args, "pools", False):
        print(yaml.safe_dump(_pool_table(cfg), sort_keys=False), end="")
        return 0
    print(yaml.safe_dump(config.to_mapping(cfg), sort_keys=False), end="")
    return 0


def _pool_table(cfg: config.AgentConfig) -> dict[str, object]:
    """Each pool's devices on this node, as `run` serves them on the node it opens the same way (MIG strategy,
    time-slicing, the SR-IOV file and DRA's share applied), and what was left out and why."""
    from agent.deviceplugin.pools import PoolConfigError

    with _opened_node(cfg, "gna-sysfs-") as node:
        try:
            scan = node.pools()
        except PoolConfigError as exc:
            raise UsageError(str(exc)) from exc
    return {"pools": {pool.resource_name: list(pool.ids) for pool in scan.pools},
            "notServed": list(scan.skipped)}


def _action_table(cfg: config.AgentConfig) -> dict[str, object]:
    """What each check does on this node once config is applied (what `xidActions` and the *Action settings
    change), so an operator sees the result of the overrides rather than reading the catalog."""
    from agent.config.load import camel_case
    from agent.health.xid import UNKNOWN_XID_ACTION, XidPolicy, action_word

    health = cfg.health
    # every `*_action` setting, read from the dataclass so that a new one cannot be left out of the table
    settings = {camel_case(f.name): getattr(health, f.name) for f in dataclasses.fields(health)
                if f.name.endswith("_action")}
    from agent.config.health import parse_check_action

    checks = health.check_action_map()
    overridden = {parse_check_action(item)[0] for item in health.check_actions}
    return {"xidActions": XidPolicy(health.xid_action_overrides()).table(),
            "unknownXid": action_word(UNKNOWN_XID_ACTION),
            "checks": settings,
            "checkActions": [{"check": name, "action": action,
                              "source": "override" if name in overridden else "default"}
                             for name, action in sorted(checks.items())]}


def _cmd_netacct(args: argparse.Namespace) -> int:
    from agent.netacct.command import cleanup_command
    from agent.shaping.command import remaining

    code = cleanup_command(_load_config(args).netacct, out=sys.stdout)
    # Until this release `netacct cleanup` removed shaping's objects too: an uninstall that still runs only this
    # command is told what it leaves behind instead of leaving shapers on the pods' interfaces silently.
    left = remaining()
    if left:
        sys.stdout.write(f"shaping objects remain ({left}): netacct cleanup leaves them; remove them with "
                         "`gpu-node-agent shaping cleanup`\n")
    return code


def _cmd_shaping(args: argparse.Namespace) -> int:
    from agent.shaping.command import cleanup_command

    return cleanup_command(out=sys.stdout)


def _cmd_dropin_exclusion(args: argparse.Namespace) -> int:
    from agent.deviceplugin.dropin import DropinPatchError, exclusion_patch, is_label_key

    if not is_label_key(args.label):
        raise UsageError(f"--label {args.label[:80]!r} is not a label key such as gpunodeagent.io/drop-in")
    text = sys.stdin.read((1 << 20) + 1)
    if len(text) > 1 << 20:
        raise UsageError("stdin: larger than 1 MiB; expected one DaemonSet as JSON")
    try:
        patch = exclusion_patch(json.loads(text), args.label)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError and DropinPatchError are ValueErrors
        raise UsageError(f"stdin: {str(exc)[:200] if isinstance(exc, DropinPatchError) else 'not a DaemonSet as JSON'}"
                         ) from None
    print(json.dumps(patch))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    import asyncio

    from agent import doctor
    from agent.node import open_node

    cfg = _load_config(args)
    with tempfile.TemporaryDirectory(prefix="gna-doc-") as tmp:
        node = open_node(cfg, Path(tmp), unreadable_ok=True)
        checks = asyncio.run(doctor.diagnose(node.cfg, node.hardware, node.scratch,
                                             has_credentials=bool(cfg.api_server.kubeconfig)))
    print(doctor.to_json(checks) if args.json else doctor.to_table(checks))
    return doctor.exit_code(checks)


def _cmd_fleet(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from agent.fleet.report import assess, collect, to_text
    from agent.fleet.verdicts import FleetKeys
    from agent.kube.errors import ApiError, ClusterConfigError

    cfg = _load_config(args)
    if not args.repeat.isdigit() or not 1 <= int(args.repeat) <= 1000:
        raise UsageError(f"--repeat {args.repeat[:40]!r} is not a whole number from 1 to 1000")
    if len(args.selector) > 4096:
        raise UsageError("--selector: longer than 4096 characters")
    repeat = int(args.repeat)
    try:
        nodes = asyncio.run(collect(args.selector, cfg.api_server.kubeconfig, cfg.api_server.timeout_seconds))
    except ClusterConfigError as exc:
        raise UsageError(str(exc)) from exc
    except ApiError as exc:
        if exc.code == 400:  # the server refused the selector
            raise UsageError(f"the API server refused the node list: {exc.message[:200]}") from exc
        print(f"gpu-node-agent fleet: cannot list nodes: {str(exc)[:300]}", file=sys.stderr)
        return 1
    fleet = assess(nodes, FleetKeys.of(cfg.remediation.condition_type, cfg.remediation.prefix), time.time(), repeat)
    print(json.dumps(fleet.to_json()) if args.json else to_text(fleet, repeat))
    return 0


class _Held(logging.Handler):
    """Keeps what config loading logs until the log level and format it reads are set up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _load_config_held(args: argparse.Namespace) -> tuple[config.AgentConfig, list[logging.LogRecord]]:
    """`_load_config`, with what the config package logs meanwhile (a raised interval, NVIDIA's names read)
    held back, to be logged once logging is set up as the config says (JSON lines, not a bare stderr line)."""
    logger = logging.getLogger("agent.config")
    held, level, propagate = _Held(), logger.level, logger.propagate
    logger.addHandler(held)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        return _load_config(args), held.records
    finally:
        logger.removeHandler(held)
        logger.setLevel(level)
        logger.propagate = propagate


def _cmd_run(args: argparse.Namespace) -> int:
    from agent import app

    cfg, records = _load_config_held(args)
    if cfg.device_plugin.enabled:
        _read_sriov_dp_config(cfg)  # refused here with exit 2, before anything starts (the device plugin reads it)
    setup_logging(cfg.log_level, cfg.log_format)
    for record in records:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
    return app.main(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gpu-node-agent` console script."""
    from agent.simulate.profiles import UnknownProfileError
    from agent.topology.nccl_xml import TopologyXmlError

    args = _parser().parse_args(argv)
    if args.command != "run":
        setup_logging("warning", "text")
    handlers = {"run": _cmd_run, "topology": _cmd_topology, "simulate-node": _cmd_simulate_node,
                "simulate-dcgm-exporter": _cmd_simulate_dcgm_exporter, "config": _cmd_config, "doctor": _cmd_doctor,
                "fleet": _cmd_fleet,
                "netacct": _cmd_netacct,
                "shaping": _cmd_shaping, "dropin-exclusion": _cmd_dropin_exclusion}
    try:
        return handlers[args.command](args)
    except (UsageError, config.ConfigError, UnknownProfileError, TopologyXmlError) as exc:
        print(f"gpu-node-agent {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
