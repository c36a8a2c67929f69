"""The docs match the agent (issue 29): every `run` flag is documented in the README or deploy/configmap.yaml,
the test command's optional system packages are named, and the licence the package declares is shipped."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from agent.config import model
from agent.config.load import _flagged_fields, camel_case

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIGMAP = (ROOT / "deploy" / "configmap.yaml").read_text(encoding="utf-8")


def test_every_run_flag_is_documented() -> None:
    undocumented = []
    for item in _flagged_fields(model.AgentConfig):
        flag = item.field.metadata.get("flag")
        if not flag:
            continue
        dotted = ".".join(camel_case(part) for part in item.path)
        key = camel_case(item.path[-1])
        if flag in README or re.search(rf"\b{key}\b", README) or re.search(rf"^\s*{key}:", CONFIGMAP, re.MULTILINE):
            continue
        undocumented.append(f"{flag} ({dotted})")
    assert not undocumented, f"flags neither in README nor in deploy/configmap.yaml: {undocumented}"


def test_the_declared_licence_is_shipped() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["license"]
    assert declared == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]


def test_the_optional_system_packages_of_the_test_command_are_named() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    packages = [word for word in ci.split("--no-install-recommends", 1)[1].split(">", 1)[0].split() if word != "\\"]
    assert packages and all(f"`{package}`" in README for package in packages), packages
