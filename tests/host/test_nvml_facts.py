"""`RealNvml.facts` over the real `pynvml` wrappers and a stand-in libnvidia-ml (tests/fakes/libnvml.py): the calls
GPU Feature Discovery makes for its labels, and a failing call failing the whole reading (never a partial one)."""

from __future__ import annotations

import uuid

import pynvml
import pytest

from agent.host.nvml import GpuFacts, NvmlError, NvmlFacts, RealNvml
from tests.fakes.libnvml import StandInGpu, StandInLibNvml


def test_a_reading_is_what_gfd_reads():
    cluster = uuid.UUID("2c1f5b3e-9d4a-4f6b-8e7c-0a1b2c3d4e5f")
    gpus = [StandInGpu("GPU-a", bus_id="00000000:1B:00.0", cluster_uuid=cluster.bytes, clique_id=7),
            StandInGpu("GPU-b", bus_id="00000000:43:00.0", name="Tesla V100-SXM2-16GB", memory_total=16160 << 20,
                       compute=(7, 0), mig_mode=None, fabric_state=pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED)]
    library = StandInLibNvml(gpus)
    with library.install():
        facts = RealNvml(pynvml).facts()
    assert facts == NvmlFacts("570.124.06", 12080, (
        GpuFacts("GPU-a", "0000:1b:00.0", "NVIDIA H100 80GB HBM3", 81559, (9, 0), True, False, (),
                 (str(cluster), "7")),
        GpuFacts("GPU-b", "0000:43:00.0", "Tesla V100-SXM2-16GB", 16160, (7, 0), False, False, (), None)))


def test_a_gpu_not_registered_with_a_fabric_has_no_clique_and_a_lost_gpu_fails_the_reading():
    library = StandInLibNvml([StandInGpu("GPU-a", fabric_state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
                                         cluster_uuid=uuid.uuid4().bytes), StandInGpu("GPU-b")])
    with library.install():
        nvml = RealNvml(pynvml)
        assert [g.clique for g in nvml.facts().gpus] == [None, None]
        library.gpus[1].lost = True
        with pytest.raises(NvmlError):
            nvml.facts()
