#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py's docstring says what each step checks): one short prepared run on a machine with
# one CUDA GPU, from this source tree against that machine's own PyTorch (>= 2.11; nothing is pip-installed from the
# network). Results: $OUT (the device tool's folder) or bench/results/gpu_check: gpu_check.json, gpu_check.log and
# the files the steps write.
#   bash bench/gpu_check.sh [GPU] [--dry]  GPU: the -g name of this machine's GPU type (default h100; an H200 has the
#                                          H100's dense BF16 peak and NVLink, and the harness knows it as h100);
#                                          --dry prints the steps' commands
#   bash bench/gpu_check.sh cpu            the same steps on CPU ranks (gloo): checks the script itself
#   bash bench/gpu_check.sh wheels [PKG..] here, before: the wheels of the packages the device image lacks (omegaconf
#                                          and PyYAML, which the project imports; more by name) into .wheels/, built
#                                          for the image's interpreter (WHEELS_PYTHON, default 3.12), not this one's
# The device image has no omegaconf: run `bash bench/gpu_check.sh wheels` first and carry .wheels (git-ignored); the
# script installs from it, offline, when omegaconf or yaml does not import there, and goes on if that install fails
# (the env step then names what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=${WHEELS:-.wheels}
if [ "${1:-}" = wheels ]; then
  shift
  exec "$python" -m pip download -q --only-binary=:all: --python-version "${WHEELS_PYTHON:-3.12}" \
    -d "$wheels" omegaconf PyYAML "$@"
fi
gpu=${1:-h100}
device=cuda
if [ "$gpu" = cpu ]; then device=cpu; gpu=h100; fi
out=${OUT:-bench/results/gpu_check}
if ! "$python" -c "import omegaconf, yaml" 2>/dev/null && [ -d "$wheels" ]; then
  "$python" -m pip install -q --no-index --find-links "$wheels" omegaconf PyYAML ||
    echo "gpu_check.sh: installing omegaconf and PyYAML from $wheels failed; going on (the env step names what is missing)" >&2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" bench/gpu_check.py run --gpu "$gpu" --device "$device" --out "$out" "${@:2}"
