#!/usr/bin/env bash
# What tests/test_slurm_cluster.py needs: the Debian packages slurm-wlm (slurmctld, slurmd,
# sbatch) and munge, installed when missing and this is root. Bounded in time, and never fails
# CI: where they cannot be installed the tests skip, naming what is missing, and this script says
# why here. The test itself configures and starts the one-node cluster (and munged) in a
# temporary folder.
set -u
missing=()
for tool in slurmctld slurmd sbatch munged; do
    command -v "$tool" >/dev/null 2>&1 || [[ -x "/usr/sbin/$tool" ]] || missing+=("$tool")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ "$(id -u)" != 0 ]]; then
    echo "setup_slurm: ${missing[*]} missing and not root: the Slurm tests will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_slurm: ${missing[*]} missing and no apt-get here: the Slurm tests will skip"
    exit 0
fi
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
if timeout 300 apt-get update -q >"$log" 2>&1 &&
   timeout 600 apt-get install -y -q slurm-wlm munge >>"$log" 2>&1; then
    echo "setup_slurm: installed slurm-wlm and munge"
else
    echo "setup_slurm: apt-get could not install slurm-wlm and munge (the Slurm tests will skip):"
    tail -n 20 "$log"
fi
rm -f "$log"
exit 0
