#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py's docstring says what each step checks): one short prepared run on a machine with
# one CUDA GPU, from this source tree against that machine's own PyTorch (>= 2.11; nothing is pip-installed from the
# network). Results: $OUT (the device tool's folder) or bench/results/gpu_check: gpu_check.json, gpu_check.log and
# the files the steps write.
#   bash bench/gpu_check.sh [GPU]         GPU: the -g name of this machine's GPU type (default h100; an H200 has the
#                                         H100's dense BF16 peak and NVLink, and the harness knows it as h100)
#   bash bench/gpu_check.sh cpu           the same steps on CPU ranks (gloo): checks the script itself
# Packages the machine lacks (its image has no omegaconf): put their wheels in .wheels/ here first (pip download
# omegaconf antlr4-python3-runtime==4.9.3 -d .wheels; .wheels is git-ignored, so carry it) and they are installed
# from there, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=${1:-h100}
device=cuda
if [ "$gpu" = cpu ]; then device=cpu; gpu=h100; fi
out=${OUT:-bench/results/gpu_check}
python=${PYTHON:-python3}
if ! "$python" -c "import omegaconf" 2>/dev/null && [ -d .wheels ]; then
  "$python" -m pip install -q --no-index --find-links .wheels omegaconf
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" bench/gpu_check.py run --gpu "$gpu" --device "$device" --out "$out"
