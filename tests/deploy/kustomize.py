"""The kustomize trees the Helm chart must equal, rendered without kubectl (CI has none) or with it where present.

`build_without_kubectl(tree)` renders one of TREES. It reads the kustomization files themselves (resources,
components, configMapGenerator, namespace, labels, images, strategic-merge patches): the subset deploy/ and
overlays/ use, checked against kubectl's kustomize (`build_with_kubectl`) by test_helm_chart.py wherever kubectl
is installed. A feature this renderer does not know makes it raise instead of silently rendering something else.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.manifests import ROOT, apply_patch

KUBECTL = shutil.which("kubectl")
# tree -> (resources, components) of a kustomization that builds it, relative to the repository root
TREES: dict[str, tuple[list[str], list[str]]] = {
    "deploy": (["deploy"], []),
    "dropin": (["overlays/dropin"], []),
    "monitoring": (["deploy"], ["deploy/monitoring"]),
    "dra": (["deploy"], ["deploy/dra"]),
    "gfd-read": (["deploy", "deploy/gfd-read"], []),
    "nvsentinel": (["deploy"], ["deploy/nvsentinel"]),
}
CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "DeviceClass",
                            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"})
_KNOWN_KEYS = frozenset({"apiVersion", "kind", "namespace", "labels", "resources", "components", "images",
                         "configMapGenerator", "patches"})

Doc = dict[str, Any]


def _files(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def _generate(directory: Path, generator: dict[str, Any], namespace: str | None) -> Doc:
    if set(generator) - {"name", "namespace", "files", "options"} or \
            set(generator.get("options", {})) - {"disableNameSuffixHash", "labels"}:
        raise NotImplementedError(f"configMapGenerator field in {directory}: {generator}")
    assert generator["options"]["disableNameSuffixHash"] is True, "a name hash is not rendered here"
    data = {}
    for entry in generator["files"]:
        key, _, file = entry.rpartition("=")
        data[key or Path(file).name] = (directory / file).read_text(encoding="utf-8")
    metadata: dict[str, Any] = {"name": generator["name"], "labels": dict(generator["options"].get("labels", {}))}
    if generator.get("namespace", namespace):
        metadata["namespace"] = generator.get("namespace", namespace)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _kustomize(directory: Path, *, component: bool = False, docs: list[Doc] | None = None) -> list[Doc]:
    """One kustomization (or Component, applied onto `docs`), in kustomize's order: resources, components,
    generators, then this level's transformers over what this level holds."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    if set(spec) - _KNOWN_KEYS:
        raise NotImplementedError(f"{directory}/kustomization.yaml: {sorted(set(spec) - _KNOWN_KEYS)}")
    assert (spec["kind"] == "Component") is component
    own: list[Doc] = list(docs or [])
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        own += _kustomize(path) if path.is_dir() else _files(path)
    for entry in spec.get("components", []):
        own = _kustomize((directory / entry).resolve(), component=True, docs=own)
    namespace = spec.get("namespace")
    own += [_generate(directory, generator, namespace) for generator in spec.get("configMapGenerator", [])]
    for doc in own:
        if namespace and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace
        for entry in spec.get("labels", []):
            assert not entry.get("includeSelectors") and not entry.get("includeTemplates"), "metadata labels only"
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
        for image in spec.get("images", []):
            for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if container["image"].rpartition(":")[0] == image["name"]:
                    container["image"] = f"{image['name']}:{image['newTag']}"
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise NotImplementedError(f"patch form in {directory}: {entry}")
        own = apply_patch(own, yaml.safe_load((directory / entry["path"]).read_text(encoding="utf-8")))
    return own


def build_without_kubectl(tree: str) -> list[Doc]:
    """`tree` rendered by the renderer above."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        resources, components = TREES[tree]
        (directory / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [str(ROOT / r) for r in resources], "components": [str(ROOT / c) for c in components]}))
        return _kustomize(directory)


def build_with_kubectl(tree: str) -> list[Doc]:
    """`tree` rendered by kubectl's kustomize (it refuses absolute paths: the trees are copied next to it)."""
    assert KUBECTL is not None
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        for top in ("deploy", "overlays"):
            shutil.copytree(ROOT / top, directory / top)
        resources, components = TREES[tree]
        (directory / "build").mkdir()
        (directory / "build" / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [f"../{r}" for r in resources], "components": [f"../{c}" for c in components]}))
        result = subprocess.run([KUBECTL, "kustomize", str(directory / "build")], capture_output=True, text=True,
                                timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

