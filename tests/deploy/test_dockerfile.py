"""Lint-level checks of images/Dockerfile (no container engine needed): multi-stage on python slim, the runtime
stage installs only iptables and ipset and copies the venv, OCI labels, the entrypoint the DaemonSet expects."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from agent import __version__
from tests.deploy.manifests import DOCKERFILE, DOCKERIGNORE, agent_container

BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|make|build-essential|python3?-dev|libc6?-dev|clang|cmake|git)\b")
LABEL_KEYS = {"org.opencontainers.image.title", "org.opencontainers.image.description",
              "org.opencontainers.image.version", "org.opencontainers.image.revision",
              "org.opencontainers.image.source", "org.opencontainers.image.licenses",
              "org.opencontainers.image.created"}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _parse() -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with line continuations joined and comments kept per stage."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    pending_comments: list[str] = []
    logical = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not logical and line.startswith("#"):
            pending_comments.append(line.lstrip("# "))
            continue
        if not line:
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, rest = logical.partition(" ")
        keyword, rest, logical = keyword.upper(), rest.strip(), ""
        if keyword == "FROM":
            parts = rest.split()
            stage = Stage(base=parts[0], name=parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else None)
            stage.comments.extend(pending_comments)
            stages.append(stage)
        elif not stages:
            if keyword == "ARG" and "=" in rest:
                key, _, value = rest.partition("=")
                args[key] = value
        else:
            stages[-1].comments.extend(pending_comments)
            stages[-1].instructions.append((keyword, rest))
        pending_comments = []
    return args, stages


ARGS, STAGES = _parse()


def _resolve(base: str) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: ARGS.get(m.group(1) or m.group(2), m.group(0)), base)


def test_multi_stage_on_python_slim_pinned_by_digest():
    assert len(STAGES) >= 2
    for stage in STAGES:
        assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", _resolve(stage.base)), stage.base
    assert STAGES[0].name == "builder"


def test_builder_installs_the_locked_dependencies_by_hash_then_the_package_without_cache():
    runs = STAGES[0].all("RUN")
    assert "python -m venv /opt/venv" in " ".join(runs)
    pip_runs = [run for run in runs if "pip install" in run]
    assert all("--no-cache-dir" in run for run in pip_runs)
    assert "--require-hashes" in pip_runs[0] and "-r requirements.lock" in pip_runs[0], "dependencies first, hashed"
    assert all("--no-deps" in run for run in pip_runs), "nothing may be resolved past the lock"
    assert re.search(r"pip install --no-cache-dir --no-deps --no-build-isolation \.", pip_runs[-1])


def test_the_lock_pins_every_runtime_dependency_with_a_hash():
    import tomllib

    lock = (DOCKERFILE.parent / "requirements.lock").read_text(encoding="utf-8")
    entries = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s]+) \\\n\s+--hash=sha256:([0-9a-f]{64})$", lock, re.M)
    pinned = {re.sub(r"[-_.]+", "-", name).lower() for name, _, _ in entries}
    requirement_lines = [line for line in lock.splitlines() if line and not line.startswith((" ", "#"))]
    assert len(entries) == len(requirement_lines), "every requirement carries exactly one hash"
    project = tomllib.loads((DOCKERFILE.parent.parent / "pyproject.toml").read_text(encoding="utf-8"))
    needed = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]).lower()
              for dep in project["project"]["dependencies"]}
    needed |= {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]).lower()
               for dep in project["build-system"]["requires"]}
    assert needed <= pinned, f"not in the lock: {sorted(needed - pinned)}"


def test_runtime_stage_has_the_netfilter_tools_and_no_build_tools():
    final = STAGES[-1]
    runs = final.all("RUN")
    installs = [run for run in runs if "apt-get install" in run]
    assert len(installs) == 1
    (install,) = installs
    assert "--no-install-recommends" in install
    packages = set(install.split("apt-get install", 1)[1].split("&&", 1)[0].split()) - {"-y", "--no-install-recommends"}
    assert packages == {"nftables", "iptables", "ipset"}
    assert "rm -rf /var/lib/apt/lists/*" in install
    for run in runs:
        assert not BUILD_TOOLS.search(run), f"build tool in the runtime stage: {run}"
        assert "pip install" not in run, "the runtime stage copies the venv, it does not build"
    assert any(src.startswith("--from=builder /opt/venv") for src in final.all("COPY"))


def test_labels_and_version():
    final = STAGES[-1]
    labels = " ".join(final.all("LABEL"))
    keys = set(re.findall(r"(org\.opencontainers\.image\.[\w.]+)=", labels))
    assert keys >= LABEL_KEYS
    versions = [arg.partition("=")[2] for arg in final.all("ARG") if arg.startswith("VERSION=")]
    assert versions == [__version__]


def test_entrypoint_matches_the_daemonset():
    final = STAGES[-1]
    (entrypoint,) = final.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["gpu-node-agent", "run"], "exec form, so SIGTERM reaches the agent"
    container = agent_container()
    assert "command" not in container, "the DaemonSet passes only args; the image's entrypoint runs the agent"
    assert container["args"][0].startswith("--")


def test_runs_as_root_and_says_why():
    final = STAGES[-1]
    assert final.all("USER") in ([], ["0:0"], ["0"], ["root"])
    text = " ".join(final.comments).lower()
    for reason in ("root", "device-plugins", "iptables", "net_admin", "allowprivilegeescalation"):
        assert reason in text, f"the root rationale should mention {reason}"


def test_dockerignore_keeps_the_context_to_what_pip_needs():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "allow-list style: ignore everything, then re-include"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert included == {"pyproject.toml", "README.md", "agent", "images/requirements.lock"}
    copied = set()
    for stage in STAGES:
        for args in stage.all("COPY"):
            if not args.startswith("--from"):
                copied.update(part.rstrip("/").removeprefix("./") for part in args.split()[:-1])
    assert copied <= included, f"COPY of files the .dockerignore excludes: {copied - included}"
