"""Every overlay under overlays/ that patches the base (kubectl apply -k) renders to objects the API server
accepts, validated strictly against the oldest supported and the newest Kubernetes schema. The drop-in overlay,
which also generates a ConfigMap, has its own test (test_dropin_overlay)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.manifests import CRD_GROUPS, render_overlay


@pytest.mark.parametrize("overlay", ("reboot-kured", "gpu-reset", "monitoring"))
@pytest.mark.parametrize("version", ("1.30", kubernetes_validate.latest_version()))
def test_every_object_validates_strictly(overlay: str, version: str) -> None:
    for doc in render_overlay(overlay):
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
