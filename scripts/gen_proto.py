#!/usr/bin/env python3
"""Regenerate the committed Python stubs of the kubelet APIs (device plugin v1beta1, plugin registration v1).

Why this exists: the generated code in ``agent/deviceplugin/v1beta1`` is committed so that the
agent installs without a protobuf compiler, and ``tests/test_proto.py`` regenerates it to catch
drift between ``proto/deviceplugin/v1beta1/api.proto`` and the committed stubs. Both must use the
same generator, so this script refuses to run unless the installed grpcio-tools is exactly the
version pinned in ``pyproject.toml`` (the ``test`` extra): a different version emits different
code and a different runtime-version guard.

The proto is staged in a temporary include root as ``agent/deviceplugin/v1beta1/api.proto`` so
that protoc emits package-absolute imports (``from agent.deviceplugin.v1beta1 import api_pb2``).

Usage::

    python scripts/gen_proto.py              # rewrite the committed files in the repo
    python scripts/gen_proto.py --out DIR    # write DIR/agent/deviceplugin/v1beta1/api_pb2*.py[i]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import re
import shutil
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

log = logging.getLogger("gen_proto")

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_SOURCE = REPO_ROOT / "proto" / "deviceplugin" / "v1beta1" / "api.proto"
# Path of the proto inside the staged include root; it decides the generated module's package.
PROTO_VIRTUAL_PATH = Path("agent", "deviceplugin", "v1beta1", "api.proto")
# Every proto the agent speaks: (source under proto/, staged path that decides the generated package).
PROTOS: tuple[tuple[Path, Path], ...] = (
    (PROTO_SOURCE, PROTO_VIRTUAL_PATH),
    (REPO_ROOT / "proto" / "pluginregistration" / "v1" / "api.proto",
     Path("agent", "deviceplugin", "pluginregistration", "v1", "api.proto")),
)


def _outputs(virtual: Path) -> tuple[Path, ...]:
    stem = virtual.with_suffix("")
    return (stem.with_name(stem.name + "_pb2.py"), stem.with_name(stem.name + "_pb2.pyi"),
            stem.with_name(stem.name + "_pb2_grpc.py"))


GENERATED_DIR = PROTO_VIRTUAL_PATH.parent
GENERATED_FILES: tuple[Path, ...] = tuple(path for _, virtual in PROTOS for path in _outputs(virtual))
TOOLS_DIST = "grpcio-tools"


class GenerationError(RuntimeError):
    """Raised when the stubs cannot be (re)generated reproducibly."""


def pinned_tools_version(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """Return X from the ``grpcio-tools==X`` requirement in the ``test`` optional extra."""
    with pyproject.open("rb") as fh:
        data = tomllib.load(fh)
    extras = data.get("project", {}).get("optional-dependencies", {})
    pattern = re.compile(rf"^\s*{re.escape(TOOLS_DIST)}\s*==\s*([^\s;,]+)\s*(?:;.*)?$", re.IGNORECASE)
    for requirement in extras.get("test", []):
        match = pattern.match(requirement)
        if match:
            return match.group(1)
    raise GenerationError(f"{pyproject}: no '{TOOLS_DIST}==X' pin in [project.optional-dependencies] test")


def check_tools_version(pinned: str) -> str:
    """Fail unless the installed grpcio-tools is exactly ``pinned``; return the installed version."""
    try:
        installed = importlib.metadata.version(TOOLS_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise GenerationError(
            f"{TOOLS_DIST} is not installed; install the pinned version: pip install '{TOOLS_DIST}=={pinned}'"
        ) from exc
    if installed != pinned:
        raise GenerationError(
            f"{TOOLS_DIST} {installed} is installed but pyproject.toml pins {pinned}; generated code "
            f"would differ from the committed stubs. Run: pip install '{TOOLS_DIST}=={pinned}'"
        )
    return installed


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every proto in PROTOS and write the stubs under ``out_root``; return the written paths."""
    check_tools_version(pinned_tools_version())
    written: list[Path] = []
    for proto, virtual in PROTOS:
        written.extend(_generate_one(out_root, proto, virtual))
    return written


def _generate_one(out_root: Path, proto: Path, virtual: Path) -> list[Path]:
    from grpc_tools import protoc  # imported after the version check so a wrong version fails clearly

    if not proto.is_file():
        raise GenerationError(f"proto source not found: {proto}")
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="gen_proto_") as staging:
        include_root = Path(staging)
        staged = include_root / virtual
        staged.parent.mkdir(parents=True)
        shutil.copyfile(proto, staged)
        argv = [
            "grpc_tools.protoc",
            f"-I{include_root}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(staged),
        ]
        log.debug("protoc argv: %s", argv)
        rc = protoc.main(argv)
    if rc != 0:
        raise GenerationError(f"protoc failed with exit status {rc} (see its messages above)")
    written = [out_root / rel for rel in _outputs(virtual)]
    missing = [str(p) for p in written if not p.is_file()]
    if missing:
        raise GenerationError(f"protoc did not produce: {', '.join(missing)}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: regenerate the stubs, print the written paths, return an exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="output root; files land in OUT/agent/... beside the committed ones (default: the repository)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the protoc command line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(name)s: %(message)s")
    try:
        written = generate(args.out.resolve())
    except GenerationError as exc:
        log.error("%s", exc)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
