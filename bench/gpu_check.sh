#!/bin/bash
# Runs a GPU bundle on the GPU machine (CUDA, or HIP on an MI300 host: the driver backend.json
# names): first a few small cases under each runtime setting of that driver, then every case under
# the first setting that passed them (bench-* cases first: the timed table). At most 6 minutes
# when the first probe passes. Usage (inside the bundle):
#   bash gpu_check.sh OUT_DIR [MAX_SECONDS]
out=${1:-.}; budget=${2:-240}
export PYTHONUNBUFFERED=1
driver=$(python3 -c 'import json; print(json.load(open("backend.json"))["driver"])' 2>/dev/null || echo cuda)
if [ "$driver" = hip ]; then
  amd-smi list 2>/dev/null || rocm-smi --showproductname
  settings=("")
else
  nvidia-smi -L
  settings=("" "--runtime-flag=--cuda_async_allocations=false" "--runtime-flag=--cuda_use_streams=true"
            "--runtime-flag=--cuda_async_allocations=false --runtime-flag=--cuda_use_streams=true")
fi
chosen=none
for flags in "${settings[@]}"; do
  echo "== probe ($driver): ${flags:-default flags}"
  if timeout 60 python3 gpu_runner.py --driver "$driver" $flags --only hq4_hkv2 --log "$out/probe.log"; then
    chosen="$flags"; break
  fi
done
[ "$chosen" = none ] && { echo "no $driver runtime setting passed the probe cases"; exit 1; }
echo "== every case ($driver): ${chosen:-default flags}"
timeout $((budget + 60)) python3 gpu_runner.py --driver "$driver" $chosen --repeat 10 --max-seconds "$budget" \
  --log "$out/cases.log"
