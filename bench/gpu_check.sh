#!/bin/bash
# Runs a GPU bundle on the GPU machine: first a few small cases under each CUDA runtime setting,
# then every case under the first setting that passed them (bench-* cases first: the timed
# table). At most 6 minutes when the first probe passes. Usage (inside the bundle):
#   bash gpu_check.sh OUT_DIR [MAX_SECONDS]
out=${1:-.}; budget=${2:-240}
export PYTHONUNBUFFERED=1
nvidia-smi -L
chosen=none
for flags in "" "--runtime-flag=--cuda_async_allocations=false" "--runtime-flag=--cuda_use_streams=true" \
             "--runtime-flag=--cuda_async_allocations=false --runtime-flag=--cuda_use_streams=true"; do
  echo "== probe: ${flags:-default flags}"
  if timeout 60 python3 gpu_runner.py $flags --only hq4_hkv2 --log "$out/probe.log"; then
    chosen="$flags"; break
  fi
done
[ "$chosen" = none ] && { echo "no CUDA runtime setting passed the probe cases"; exit 1; }
echo "== every case: ${chosen:-default flags}"
timeout $((budget + 60)) python3 gpu_runner.py $chosen --repeat 10 --max-seconds "$budget" --log "$out/cases.log"
