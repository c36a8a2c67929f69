"""dcgm-exporter's counter catalogue: names, Prometheus types and help texts, and how DCGM values print.

Kept apart from the simulated exporter so the exporter module stays about behaviour. The help texts and types
are those of dcgm-exporter's etc/default-counters.csv; `default` marks the counters a stock exporter enables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

XID_GAUGE = "DCGM_FI_DEV_XID_ERRORS"
_FIELD_NAME = re.compile(r"^DCGM_FI_[A-Z0-9_]+$")
_LANE_FIELD = re.compile(r"^DCGM_FI_DEV_NVLINK_(CRC_FLIT|CRC_DATA|REPLAY|RECOVERY)_ERROR_COUNT_L(1[0-7]|[0-9])$")
_LANE_HELP = {"CRC_FLIT": "flow-control CRC errors", "CRC_DATA": "data CRC errors", "REPLAY": "retries",
              "RECOVERY": "recovery errors"}


@dataclass(frozen=True)
class FieldSpec:
    """One counter as the exporter's CSV declares it."""

    name: str
    prom_type: str
    help: str
    default: bool = False  # enabled in the stock CSV; the others render once set (or with extra_fields)
    double: bool = False  # a DCGM_FT_DOUBLE field: Go prints it with %f


# DCGM field-id order, which is the order dcgm-exporter's template renders families in.
FIELDS = {f.name: f for f in (
    FieldSpec("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", default=True),
    FieldSpec("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", default=True),
    FieldSpec("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", default=True),
    FieldSpec("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", default=True),
    FieldSpec("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", default=True, double=True),
    FieldSpec("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
              default=True),
    FieldSpec("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", default=True),
    FieldSpec("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", default=True),
    FieldSpec("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", default=True),
    FieldSpec("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", default=True),
    FieldSpec("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", default=True),
    FieldSpec(XID_GAUGE, "gauge", "Value of the last XID error encountered."),  # rendered when "gauge" is enabled
    FieldSpec("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Throttling duration due to power constraints (in us)."),
    FieldSpec("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "Throttling duration due to thermal constraints (in us)."),
    FieldSpec("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", default=True),
    FieldSpec("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", default=True),
    FieldSpec("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    FieldSpec("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    FieldSpec("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Total number of single-bit persistent ECC errors."),
    FieldSpec("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Total number of double-bit persistent ECC errors."),
    FieldSpec("DCGM_FI_DEV_RETIRED_SBE", "counter", "Total number of retired pages due to single-bit errors."),
    FieldSpec("DCGM_FI_DEV_RETIRED_DBE", "counter", "Total number of retired pages due to double-bit errors."),
    FieldSpec("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of pages pending retirement."),
    FieldSpec("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors",
              default=True),
    FieldSpec("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
              default=True),
    FieldSpec("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", default=True),
    FieldSpec("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending"),
    FieldSpec("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter",
              "Total number of NVLink flow-control CRC errors."),
    FieldSpec("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink data CRC errors."),
    FieldSpec("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink retries."),
    FieldSpec("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink recovery errors."),
    FieldSpec("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
              "Total number of NVLink bandwidth counters for all lanes",
              default=True),
    FieldSpec("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status", default=True),
)}
OPTIONAL_FIELDS = tuple(name for name, f in FIELDS.items() if not f.default and name != XID_GAUGE)


def field_spec(name: str) -> FieldSpec:
    """The spec of any settable DCGM_FI_* name; unknown names are counters with a generic help."""
    if name in FIELDS:
        return FIELDS[name]
    if not _FIELD_NAME.match(name):
        raise ValueError(f"not a DCGM field name: {name!r}")
    if lane := _LANE_FIELD.match(name):
        return FieldSpec(name, "counter", f"Number of NVLink {_LANE_HELP[lane.group(1)]} on lane {lane.group(2)}.")
    return FieldSpec(name, "counter", f"DCGM field {name}.")


def coerce(field: FieldSpec, value: float) -> float:
    """The value as DCGM would hold it: int64 fields stay integers, double fields floats."""
    if field.double:
        return float(value)
    if float(value).is_integer():
        return int(value)
    if field.name in FIELDS:
        raise ValueError(f"{field.name} is an integer field; got {value!r}")
    return float(value)


def format_value(value: float) -> str:
    """A sample value as dcgm-exporter writes it."""
    return str(value) if isinstance(value, int) else f"{value:f}"  # Go: %d for int64, %f for doubles
