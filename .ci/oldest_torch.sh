#!/usr/bin/env bash
# The distributed part of the suite on the oldest supported torch (2.11, the GPU machines' own build: from the
# registry, the CUDA 13 wheel, which runs the CPU ranks' tests unchanged), in a venv of its own beside .venv: every
# collective kind (comm, the ring, the world's groups), TP/SP with TP overlap, DP with the distributed optimizer and
# both overlaps, PP (1F1B, interleaved, both p2p modes), EP overlap at PP 1 and under PP x VPP, MoE dispatch,
# checkpoints (resharding resumes, the state gather's memory), the NCCL-rules replays and the CUDA branch of the
# split-size read. The pinned end (2.13.0) runs the whole suite in .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=2.11.0
python3.11 -m venv .venv-oldest
# That wheel and its NVIDIA libraries are ~3 GB from the registry, and a connection dropped mid-download fails pip
# with a urllib3 read error (seen in CI): each try resumes from pip's cache, which keeps the files that arrived whole.
for try in 1 2 3 4; do
  .venv-oldest/bin/pip install -q --retries 10 --timeout 60 "torch==$OLDEST" && break
  if [ "$try" = 4 ]; then echo "torch $OLDEST: the registry download failed $try times" >&2; exit 1; fi
  echo "torch $OLDEST: the registry download failed (try $try of 4), again in $((30 * try)) s" >&2
  sleep $((30 * try))
done
# the range in pyproject.toml admits it: this keeps the installed torch
.venv-oldest/bin/pip install -q -e '.[test]'
.venv-oldest/bin/python -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(not v.startswith('$OLDEST'))"
.venv-oldest/bin/pytest -q -p no:cacheprovider \
  tests/test_world.py tests/test_ring.py tests/test_data_parallel.py tests/test_model_tp.py tests/test_tp_overlap.py \
  tests/test_pipeline.py tests/test_ep_overlap.py tests/test_ep_overlap_pp.py tests/test_moe.py \
  tests/test_checkpoint.py tests/test_checkpoint_memory.py tests/test_nccl_rules.py \
  tests/test_split_sizes_cuda_branch.py
