#!/usr/bin/env python3
"""Regenerate the committed Python stubs of the kubelet gRPC APIs the agent speaks.

Why this exists: the generated code (``agent/deviceplugin/v1beta1``, ``agent/dra/v1``, ``agent/dra/v1beta1``,
``agent/dra/health/v1alpha1``, ``agent/pluginregistration/v1``, ``agent/host/podresources/v1``,
``agent/host/nvsentinel/v1``) is committed
so that the agent installs without a protobuf compiler, and ``tests/test_proto.py`` regenerates it to catch
drift between the protos under ``proto/`` and the committed stubs. Both must use the same generator, so this
script refuses to run unless the installed grpcio-tools is exactly the version pinned in ``pyproject.toml``
(the ``test`` extra): a different version emits different code and a different runtime-version guard.

Each proto is staged in a temporary include root at its package path (``agent/dra/v1/api.proto``) so
that protoc emits package-absolute imports (``from agent.dra.v1 import api_pb2``).

Usage::

    python scripts/gen_proto.py              # rewrite the committed files in the repo
    python scripts/gen_proto.py --out DIR    # write DIR/agent/<package>/api_pb2*.py[i] for every proto
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
# proto source under proto/ -> package directory of its stubs (the staged path; it decides the module names)
PROTOS: dict[Path, Path] = {
    Path("deviceplugin", "v1beta1", "api.proto"): Path("agent", "deviceplugin", "v1beta1"),
    Path("dra", "v1", "api.proto"): Path("agent", "dra", "v1"),
    Path("dra", "v1beta1", "api.proto"): Path("agent", "dra", "v1beta1"),
    Path("dra", "health", "v1alpha1", "api.proto"): Path("agent", "dra", "health", "v1alpha1"),
    Path("pluginregistration", "v1", "api.proto"): Path("agent", "pluginregistration", "v1"),
    Path("podresources", "v1", "api.proto"): Path("agent", "host", "podresources", "v1"),
    Path("nvsentinel", "v1", "api.proto"): Path("agent", "host", "nvsentinel", "v1"),
}
GENERATED_FILES: tuple[Path, ...] = tuple(
    package / name for package in PROTOS.values() for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"))
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


def generate(out_root: Path, proto_root: Path = REPO_ROOT / "proto") -> list[Path]:
    """Run protoc on every proto in ``PROTOS`` and write the stubs under ``out_root``; return the written paths."""
    check_tools_version(pinned_tools_version())
    from grpc_tools import protoc  # imported after the version check so a wrong version fails clearly

    out_root.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    for source, package in PROTOS.items():
        proto = proto_root / source
        if not proto.is_file():
            raise GenerationError(f"proto source not found: {proto}")
        with tempfile.TemporaryDirectory(prefix="gen_proto_") as staging:
            include_root = Path(staging)
            staged = include_root / package / "api.proto"
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
            raise GenerationError(f"protoc failed on {source} with exit status {rc} (see its messages above)")
    written = [out_root / rel for rel in GENERATED_FILES]
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
        help="output root; files land in OUT/agent/<package>/ (default: the repository)",
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
