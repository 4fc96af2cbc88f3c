#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU (issue 41 item 8): a virtual environment with keras_dpsgd and the
# CUDA builds of TensorFlow and JAX, then benchmarks/device.py (DP/non-private step ratios and peak memory on
# Keras 3 TensorFlow and JAX), one JSON. About 8 minutes on a GPU; the JSON's fields: benchmarks/README.md.
#
#   bash benchmarks/device.sh                         # -> benchmarks/results/device.json
#   bash benchmarks/device.sh --out /tmp/gpu.json
#   bash benchmarks/device.sh --dry --out /tmp/d.json # tiny shapes on CPU with the current python: no install
#
# Environment: PYTHON (default python3), DEVICE_VENV (default .venv-device in the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
for arg in "$@"; do [ "$arg" = "--dry" ] && dry=1; done
case " $* " in *" --out "*) out=() ;; *) out=(--out benchmarks/results/device.json) ;; esac
if [ "$dry" = 1 ]; then
  exec "${PYTHON:-python3}" benchmarks/device.py "${out[@]}" "$@"
fi
venv="${DEVICE_VENV:-.venv-device}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # The package with its keras_hub extra, and the GPU builds of both backends (pip's CUDA wheels).
  "$venv/bin/pip" install -q -e ".[hub]" "tensorflow[and-cuda]>=2.21,<2.22" "jax[cuda12]>=0.10,<0.11"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: no GPU found" >&2
exec "$venv/bin/python" benchmarks/device.py "${out[@]}" "$@"
