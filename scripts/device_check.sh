#!/usr/bin/env bash
# Hardware truth on a real GPU machine (H100/H200), one run, bounded (under 8 minutes): issue 31 item 2.
#
# Installs the project into a fresh venv, then records under $OUT (default ./device-check-out):
#   machine.txt          uname, driver/GPU names (nvidia-smi -L), python version
#   nvidia-smi-q.txt     `nvidia-smi -q` (read-only; NO --gpu-reset is attempted on any GPU)
#   nvidia-smi-topo.txt  `nvidia-smi topo -m`
#   doctor.json          `gpu-node-agent doctor --json` (+ doctor.rc, doctor.stderr)
#   topology.json        `gpu-node-agent topology --json`, topology.txt the matrix
#   nvml_probes.json     scripts/device_probe.py: inventory, gpu_state, memory health, process lists, event wait
#   gpu_state_pass.txt   bench/gpu_state_pass.py (the agent's own per-pass cost over the stand-in library)
#   sysfs.txt            the IB/RoCE, AER and link-width files the NIC pass reads (names only, and a few values)
# Every step has its own timeout; a failed step is recorded in steps.txt and the script goes on.
# Run from the repository root:  OUT=/tmp/out bash scripts/device_check.sh
# A machine without network: WHEELS=dir (pip download -d dir '.[test]' elsewhere) installs from there; if the
# install still fails, the steps run from the source tree with $PYTHON (its pynvml, grpcio, ... must be there).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
VENV="${VENV:-$(mktemp -d)/venv}"
STEPS="$OUT/steps.txt"
: > "$STEPS"

step() {  # step NAME SECONDS OUTFILE CMD...: run with a timeout, stdout to OUTFILE, stderr beside it
    local name=$1 limit=$2 out=$3
    shift 3
    local started=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$out" 2> "$OUT/$out.stderr"
    local rc=$?
    echo "$name rc=$rc $((SECONDS - started))s" >> "$STEPS"
    [ -s "$OUT/$out.stderr" ] || rm -f "$OUT/$out.stderr"
    return 0
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "uname: $(uname -a)"
    echo "python: $($PY --version 2>&1)"
    timeout 20 nvidia-smi -L 2>&1
    timeout 20 nvidia-smi --query-gpu=driver_version,name,pci.bus_id --format=csv 2>&1
} > "$OUT/machine.txt"

PIP_FROM=()
[ -n "${WHEELS:-}" ] && PIP_FROM=(--no-index --find-links "$WHEELS")
step install 240 install.txt bash -c "'$PY' -m venv '$VENV' && '$VENV/bin/pip' install -q --disable-pip-version-check \
    ${PIP_FROM[*]} '.[test]'"
if [ -x "$VENV/bin/gpu-node-agent" ]; then
    AGENT=("$VENV/bin/gpu-node-agent")
    VPY="$VENV/bin/python"
else
    echo "install failed: running from the source tree with $PY" >> "$STEPS"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    AGENT=("$PY" -m agent)
    VPY="$PY"
fi

step nvidia-smi-q 60 nvidia-smi-q.txt nvidia-smi -q
step nvidia-smi-topo 30 nvidia-smi-topo.txt nvidia-smi topo -m
# doctor exits 1 when a check fails (e.g. no kubelet on a bare machine): that is a result, not an error
step doctor 30 doctor.json "${AGENT[@]}" doctor --json --state-dir "$OUT/state" --serve-gpus
echo "$(grep -c '"status": "fail"' "$OUT/doctor.json" 2>/dev/null) failing checks" >> "$STEPS"
step doctor-table 30 doctor.txt "${AGENT[@]}" doctor --state-dir "$OUT/state" --serve-gpus
step topology-json 60 topology.json "${AGENT[@]}" topology --json
step topology 60 topology.txt "${AGENT[@]}" topology
step nvml-probes 90 nvml_probes.json "$VPY" scripts/device_probe.py --event-wait 2
step gpu-state-pass 90 gpu_state_pass.txt "$VPY" bench/gpu_state_pass.py --trials 500
step sysfs 30 sysfs.txt bash -c '
    for d in /sys/class/infiniband/*; do
        [ -e "$d" ] || continue
        echo "== $d"; ls "$d/ports/1/counters" "$d/ports/1/hw_counters" 2>&1 | head -80
        cat "$d/ports/1/state" "$d/ports/1/rate" "$d/ports/1/link_layer" 2>&1
    done
    for f in /sys/bus/pci/devices/*; do
        if [ "$(cat "$f/vendor" 2>/dev/null)" = 0x10de ] || [ "$(cat "$f/vendor" 2>/dev/null)" = 0x15b3 ]; then
            echo "== $f width $(cat "$f/current_link_width" 2>&1)/$(cat "$f/max_link_width" 2>&1)"
            head -3 "$f/aer_dev_fatal" 2>&1
        fi
    done'
echo "done: $OUT" >> "$STEPS"
cat "$STEPS"
