"""The architecture as a test: data flows one way, and only the ports touch the outside world.

Sources (topology, nvml, simulate) never import consumers; the consumers do not import each other except
through the data they share; pynvml, lightkube, pyroute2 and subprocesses stay inside their ports. Over all
imports, lazy ones included, the module graph has no cycle and follows the layer order of
`../shared/design/architecture.md` (see LAYERS), and so does the package graph: no two packages import each
other, even through modules that do not import each other (a port choosing the simulator that imports the port).
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
    ("lightkube", {"agent.kube.cluster", "agent.kube.calls", "agent.kube.pod_calls", "agent.kube.nodefeature_calls",
                   "agent.kube.nodes"}),
    ("pyroute2", {"agent.host.tc_netlink", "agent.host.bpf_tc"}),  # shaping's tc; the eBPF layout's cls_bpf
])
def test_only_the_port_imports_its_library(library, allowed):
    assert _importers(library) <= allowed


def _source(module: str) -> str:
    path = AGENT.parent / (module.replace(".", "/") + ".py")
    return path.read_text() if path.exists() else (path.with_suffix("") / "__init__.py").read_text()


#: how a module starts a process: the subprocess module, asyncio's process API, os.exec*/spawn*/system/popen
STARTS_A_PROCESS = ("create_subprocess_", "os.system", "os.popen", "os.exec", "os.spawn", "os.posix_spawn")


def test_only_the_host_ports_start_processes():
    """Every command the agent runs (iptables, nft, ipset, the GPU reset) goes through a port in agent.host: no
    module elsewhere imports subprocess or starts a process through asyncio or os."""
    outside = {module for module in MODULES if not module.startswith("agent.host.")}
    importers = {module for module in outside if any(name == "subprocess" or name.startswith("subprocess.")
                                                     for name in MODULES[module])}
    assert not importers, f"subprocess imported outside agent.host: {sorted(importers)}"
    starters = {module for module in outside if any(call in _source(module) for call in STARTS_A_PROCESS)}
    assert not starters, f"processes started outside agent.host: {sorted(starters)}"


def test_the_process_check_sees_each_way_to_start_one():
    """The check above can fail: each spelling it looks for is one a module could use."""
    spellings = ("await asyncio.create_subprocess_exec(*argv)", "asyncio.create_subprocess_shell(line)",
                 "os.system(line)", "os.execv(path, argv)", "os.posix_spawn(path, argv, env)")
    assert all(any(call in text for call in STARTS_A_PROCESS) for text in spellings)


SOURCES = ("agent.topology", "agent.host", "agent.simulate.profiles", "agent.simulate.sysfs_writer",
           "agent.simulate.sysfs_tree", "agent.config", "agent.signals", "agent.placement")
CONSUMERS = ("agent.deviceplugin", "agent.dra", "agent.health", "agent.remediation", "agent.netacct", "agent.shaping",
             "agent.labels", "agent.kube", "agent.app", "agent.wiring", "agent.subsystems", "agent.doctor",
             "agent.cli")


@pytest.mark.parametrize("source", SOURCES)
def test_sources_never_import_consumers(source):
    for module, imports in MODULES.items():
        if module == source or module.startswith(source + "."):
            bad = {name for name in imports for consumer in CONSUMERS
                   if name == consumer or name.startswith(consumer + ".")}
            assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(("package", "forbidden"), [
    ("agent.kube", ("agent.remediation", "agent.netacct", "agent.health", "agent.deviceplugin", "agent.dra")),
    # the DRA driver reads the topology and the API; of the device plugin it shares only NVIDIA's GPU payload
    # builders (one source for a MIG device's /dev nodes), a leaf module that imports the model and config alone
    ("agent.dra", ("agent.deviceplugin", "agent.health", "agent.remediation", "agent.netacct")),
    ("agent.remediation", ("agent.netacct", "agent.health", "agent.deviceplugin")),
    ("agent.netacct", ("agent.remediation", "agent.health", "agent.deviceplugin", "agent.shaping")),
    ("agent.deviceplugin", ("agent.remediation", "agent.netacct", "agent.health", "agent.kube", "agent.dra")),
    # netacct and shaping share the pods and the internal set through agent.pods (one source per process, handed to
    # both by the wiring), never through each other: each has its own filter, logs and cleanup
    ("agent.shaping", ("agent.remediation", "agent.health", "agent.deviceplugin", "agent.dra", "agent.netacct")),
    # the pod model and sources sit below both network subsystems
    ("agent.pods", ("agent.netacct", "agent.shaping", "agent.remediation", "agent.health", "agent.deviceplugin",
                    "agent.dra")),
    # health publishes device health and verdicts (agent.signals); it never reaches into the subsystems acting on them
    ("agent.health", ("agent.deviceplugin", "agent.remediation", "agent.netacct", "agent.kube")),
    # node labels read the model, the ports and device health (agent.signals); they act through agent.kube only
    ("agent.labels", ("agent.deviceplugin", "agent.dra", "agent.remediation", "agent.netacct", "agent.shaping",
                      "agent.health", "agent.ownership")),
])
def test_consumers_stay_apart(package, forbidden):
    for module, imports in MODULES.items():
        if module.startswith(package + "."):
            bad = {name for name in imports for other in forbidden if name == other or name.startswith(other + ".")}
            bad -= SHARED_LEAVES.get(package, set())
            assert not bad, f"{module} imports {bad}"


#: consumer modules another consumer may import: leaves that import nothing of their own package
SHARED_LEAVES = {"agent.dra": {"agent.deviceplugin.nvidia"}}


@pytest.mark.parametrize(("package", "leaves"), SHARED_LEAVES.items())
def test_shared_leaves_stay_leaves(package, leaves):
    for leaf in leaves:
        owner = leaf.rsplit(".", 1)[0]
        ours = {name for name in MODULES[leaf] if name == owner or name.startswith(owner + ".")}
        assert not ours, f"{leaf}, imported by {package}, imports {ours}"


def test_the_model_takes_plain_data_from_the_host_ports():
    """topology is built from what the ports read (a UUID map), so it never imports them: no topology <-> nvml cycle."""
    for module, imports in MODULES.items():
        if module.startswith("agent.topology."):
            bad = {name for name in imports if name == "agent.host.nvml" or name.startswith("agent.host.nvml.")}
            assert not bad, f"{module} imports {bad}"
    assert not any(name.startswith("agent.topology") for name in MODULES["agent.host.nvml.real"])


def test_the_health_contract_is_one_module_that_imports_no_agent_code():
    assert not {name for name in MODULES["agent.signals"] if name.startswith("agent")}
    assert not (AGENT / "events.py").exists()


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
    assert _importers("agent.subsystems") <= {"agent.wiring"}  # the builders beside the composition root


def test_the_supervisor_and_the_clock_sit_below_every_subsystem():
    for module in ("agent.supervisor", "agent.clock", "agent.kube.reflector"):
        agent_imports = {name for name in MODULES[module] if name.startswith("agent")}
        assert agent_imports <= {"agent.clock", "agent.aio", "agent.supervisor", "agent.kube.errors",
                                 "agent.kube.model"}, module


# --- the whole import graph: every import counts (lazy ones in functions and TYPE_CHECKING ones included) ---

GENERATED_PARTS = {"v1beta1", "v1", "v1alpha1"}  # protobuf packages: data shared by whoever speaks that API


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(AGENT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_generated(module: str) -> bool:
    return bool(GENERATED_PARTS & set(module.split(".")))


PATHS = {_module_name(path): path for path in AGENT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The agent module an import name loads (its longest existing prefix), or None outside the agent."""
    while name:
        if name in PATHS:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(module: str, path: Path) -> set[str]:
    """Agent modules `module` imports: `from a.b import c` is a.b.c when c is a module, else a.b."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in PATHS else base for alias in node.names]
        found.update(target for name in names if (target := _resolve(name)) and target != module)
    return found


GRAPH = {module: _targets(module, path) for module, path in PATHS.items() if not _is_generated(module)}

# The architecture picture, lowest layer first: a module imports its own layer or those below, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    # foundation: contracts, clock, supervision, config (and the generated protobuf packages, see _layer)
    ("agent", "agent.signals", "agent.events", "agent.clock", "agent.aio", "agent.logs", "agent.supervisor",
     "agent.config", "agent.pluginregistration"),
    # the ports to the machine and the cluster, with their simulated twins: they import no model, no simulator
    ("agent.host", "agent.kube", "agent.http"),
    # the node model read from the ports, the simulator that writes a node for the same readers, and this node's
    # pods as the network subsystems see them (`agent.pods`: the pod model, the pods file or the API pod watch)
    ("agent.topology", "agent.simulate", "agent.pods"),
    # decisions over the model
    ("agent.placement", "agent.ownership", "agent.health"),
    # consumers that act
    ("agent.deviceplugin", "agent.dra", "agent.remediation", "agent.netacct", "agent.shaping", "agent.labels"),
    # the composition root, the choice between real and simulated hardware it makes, the one opened node every
    # command works from (`agent.node`: mode defaults, hardware, node paths), and the node self-check (`doctor`)
    # that opens the same node and runs the readers below once; the simulated node's sample admissions, a client
    # of the served device plugin (through the stand-in kubelet) that the composition root runs; the operator's
    # fleet view (`fleet`), which reads what remediation writes on the Nodes; the builders beside the composition
    # root (`agent.subsystems`: health, node labels, netacct, shaping)
    ("agent.wiring", "agent.subsystems", "agent.hardware", "agent.node", "agent.doctor", "agent.simulate.samples",
     "agent.fleet"),
    ("agent.app",),
    ("agent.cli", "agent.__main__"),
)


def _layer(module: str) -> int:
    if _is_generated(module):
        return 0
    matches = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer of the architecture picture: add it to LAYERS (and the picture)"
    return max(matches)[1]


def test_the_pods_sit_between_the_ports_and_both_network_subsystems():
    """netacct and shaping share the pod model, the pod source and the internal set through agent.pods alone."""
    assert _layer("agent.kube") < _layer("agent.pods") < min(_layer("agent.netacct"), _layer("agent.shaping"))
    for subsystem in ("agent.netacct", "agent.shaping"):
        assert any(target.startswith("agent.pods.") for module, targets in GRAPH.items()
                   if module.startswith(subsystem + ".") for target in targets), subsystem


def test_every_module_has_a_layer():
    for module in GRAPH:
        _layer(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{module} ({_layer(module)}) -> {target} ({_layer(target)})"
                    for module, targets in GRAPH.items() for target in targets if _layer(target) > _layer(module))
    assert not upward, "imports against the flow:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, first_children in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(first_children)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    """The check above can fail: a lazy import back up a chain is a cycle."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "agent.app" in _targets("agent.cli", AGENT / "cli.py")  # the parser sees the CLI's (lazy) import


# --- the package graph: agent.host, agent.topology, ... as nodes; an edge when any module of one imports the other ---

def _package(module: str) -> str:
    """The package a module belongs to: `agent.host.nvml.real` -> `agent.host`; a top-level module is its own.

    Generated protobuf modules count with the package that holds them (importing them runs its `__init__`).
    """
    return ".".join(module.split(".")[:2])


def _package_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], set[str]]:
    """(importer package, imported package) -> the module imports that make the edge."""
    edges: dict[tuple[str, str], set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            if _package(module) != _package(target):
                edges.setdefault((_package(module), _package(target)), set()).add(f"{module} -> {target}")
    return edges


def _package_graph(edges: dict[tuple[str, str], set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for importer, imported in edges:
        graph.setdefault(importer, set()).add(imported)
        graph.setdefault(imported, set())
    return graph


# every module, the generated ones included: a generated stub importing back up would close a cycle too
PACKAGE_EDGES = _package_edges({module: _targets(module, path) for module, path in PATHS.items()})


def test_the_package_graph_has_no_cycle():
    cycles = _cycles(_package_graph(PACKAGE_EDGES))
    assert not cycles, "packages importing each other:\n" + "\n".join(
        f"{' <-> '.join(cycle)}:\n  " + "\n  ".join(sorted(
            why for (importer, imported), found in PACKAGE_EDGES.items()
            if importer in cycle and imported in cycle for why in found))
        for cycle in cycles)


def test_the_package_check_finds_a_cycle_the_module_graph_does_not_have():
    """A port choosing the simulator, which imports another module of that port: no module cycle, a package one."""
    modules = {"agent.host.hardware": {"agent.simulate.node"}, "agent.simulate.node": {"agent.host.nvml"},
               "agent.host.nvml": set()}
    assert _cycles(modules) == []
    assert _cycles(_package_graph(_package_edges(modules))) == [["agent.host", "agent.simulate"]]


LAYOUT_NAMES = {"nft", "iptables"}  # netacct's layouts, as the config and the `layout` label name them


def _layout_switches(tree: ast.AST) -> list[int]:
    """Lines comparing a value with a layout name (`layout == "nft"`, `layout in ("auto", "nft")`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            values = [elt for op in operands for elt in (op.elts if isinstance(op, ast.Tuple | ast.List | ast.Set)
                                                         else [op])]
            if any(isinstance(v, ast.Constant) and v.value in LAYOUT_NAMES for v in values):
                lines.append(node.lineno)
    return lines


def test_nothing_switches_on_the_netacct_layout_name():
    """Each layout is one implementation of agent.netacct.layout.Layout, chosen once by name: the engine, the
    service and the doctor call the chosen one and never ask which it is (the seam a further layout plugs into)."""
    found = {module: lines for module, path in PATHS.items() if module.startswith("agent.")
             and (lines := _layout_switches(ast.parse(path.read_text(), str(path))))}
    assert not found, f"layout-name switches: {found}"


def test_the_layout_switch_check_finds_one():
    assert _layout_switches(ast.parse('if layout == "nft":\n    pass\nok = mode in ("auto", "iptables")\n')) == [1, 3]
