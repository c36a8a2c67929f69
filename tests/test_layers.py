"""The architecture as a test: data flows one way, and only the ports touch the outside world.

Sources (topology, nvml, simulate) never import consumers; the consumers do not import each other except
through the data they share; pynvml, lightkube, pyroute2 and subprocesses stay inside their ports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parent.parent / "agent"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _modules() -> dict[str, set[str]]:
    return {str(path.relative_to(AGENT.parent).with_suffix("")).replace("/", "."): _imports(path)
            for path in AGENT.rglob("*.py") if "v1beta1" not in path.parts}


MODULES = _modules()


def _importers(prefix: str) -> set[str]:
    return {module for module, imports in MODULES.items()
            if any(name == prefix or name.startswith(prefix + ".") for name in imports)}


@pytest.mark.parametrize(("library", "allowed"), [
    ("pynvml", {"agent.host.nvml.real"}),
    ("lightkube", {"agent.kube.cluster"}),
    ("pyroute2", {"agent.host.links"}),
    ("subprocess", {"agent.netacct.backend"}),
])
def test_only_the_port_imports_its_library(library, allowed):
    assert _importers(library) <= allowed


def test_subprocesses_run_only_in_the_host_ports_and_the_iptables_port():
    runners = {module for module, path in ((m, AGENT.parent / (m.replace(".", "/") + ".py")) for m in MODULES)
               if "create_subprocess_exec" in path.read_text() or "subprocess.run" in path.read_text()}
    assert runners <= {"agent.netacct.backend", "agent.host.command"}


SOURCES = ("agent.topology", "agent.host", "agent.simulate.profiles", "agent.simulate.sysfs_writer",
           "agent.simulate.sysfs_tree", "agent.config", "agent.events", "agent.placement")
CONSUMERS = ("agent.deviceplugin", "agent.dra", "agent.health", "agent.remediation", "agent.netacct", "agent.kube",
             "agent.app", "agent.wiring", "agent.cli")


@pytest.mark.parametrize("source", SOURCES)
def test_sources_never_import_consumers(source):
    for module, imports in MODULES.items():
        if module == source or module.startswith(source + "."):
            bad = {name for name in imports for consumer in CONSUMERS
                   if name == consumer or name.startswith(consumer + ".")}
            assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(("package", "forbidden"), [
    ("agent.kube", ("agent.remediation", "agent.netacct", "agent.health", "agent.deviceplugin", "agent.dra")),
    # the DRA driver reads the topology and the API; it shares no code with the device plugin or health
    ("agent.dra", ("agent.deviceplugin", "agent.health", "agent.remediation", "agent.netacct")),
    ("agent.remediation", ("agent.netacct", "agent.health", "agent.deviceplugin")),
    ("agent.netacct", ("agent.remediation", "agent.health", "agent.deviceplugin")),
    ("agent.deviceplugin", ("agent.remediation", "agent.netacct", "agent.health", "agent.kube", "agent.dra")),
    # health publishes events (agent.events) and verdicts; it never reaches into the subsystems acting on them
    ("agent.health", ("agent.deviceplugin", "agent.remediation", "agent.netacct", "agent.kube")),
])
def test_consumers_stay_apart(package, forbidden):
    for module, imports in MODULES.items():
        if module.startswith(package + "."):
            bad = {name for name in imports for other in forbidden if name == other or name.startswith(other + ".")}
            assert not bad, f"{module} imports {bad}"


def test_the_model_takes_plain_data_from_the_host_ports():
    """topology is built from what the ports read (a UUID map), so it never imports them: no topology <-> nvml cycle."""
    for module, imports in MODULES.items():
        if module.startswith("agent.topology."):
            bad = {name for name in imports if name == "agent.host.nvml" or name.startswith("agent.host.nvml.")}
            assert not bad, f"{module} imports {bad}"
    assert not any(name.startswith("agent.topology") for name in MODULES["agent.host.nvml.real"])


def test_placement_is_pure_policy_over_the_topology():
    """deviceplugin -> placement -> topology, never back: the servicer hands plain data in.

    Of the host ports only the pure bus-id helpers: placement does no I/O.
    """
    for module, imports in MODULES.items():
        if module.startswith("agent.placement."):
            ours = {name for name in imports if name == "agent" or name.startswith("agent.")}
            bad = {name for name in ours
                   if not name.startswith(("agent.placement.", "agent.topology.")) and name != "agent.host.busid"}
            assert not bad, f"{module} imports {bad}"


def test_nothing_but_the_entry_points_reads_the_environment():
    readers = {m for m in MODULES if "os.environ" in (AGENT.parent / (m.replace(".", "/") + ".py")).read_text()}
    assert readers <= {"agent.cli"}


def test_only_the_cli_imports_the_app_and_only_the_app_imports_the_wiring():
    assert _importers("agent.app") <= {"agent.cli"}
    assert _importers("agent.wiring") <= {"agent.app"}


def test_the_supervisor_and_the_clock_sit_below_every_subsystem():
    for module in ("agent.supervisor", "agent.clock", "agent.kube.reflector"):
        agent_imports = {name for name in MODULES[module] if name.startswith("agent")}
        assert agent_imports <= {"agent.clock", "agent.supervisor", "agent.kube.errors", "agent.kube.model"}, module
