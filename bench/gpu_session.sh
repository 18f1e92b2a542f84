#!/bin/bash
# One device call for a session lent a GPU (the CUDA issue's order): the sweep first, then the GPU
# check, each under its own time budget. Prepare here: `make gpu-session` (build/gpu-bundle with
# its wheels, build/gpu-sweep without: it imports the runtime the bundle unpacks), then run on the
# device with both folders carried:
#   bash bench/gpu_session.sh OUT_DIR [SWEEP_SECONDS] [CHECK_SECONDS]
# OUT_DIR gets sweep.log, probe.log and cases.log.
out=${1:-${OUT:-.}}; sweep=${2:-200}; check=${3:-240}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 "$root/build/gpu-bundle/gpu_runner.py" --only no-such-case > /dev/null   # unpacks the bundle's wheels
export PYTHONPATH="$root/build/gpu-bundle/deps${PYTHONPATH:+:$PYTHONPATH}"
echo "== sweep (at most ${sweep} s of cases)"
(cd "$root/build/gpu-sweep" && timeout $((sweep + 90)) python3 gpu_runner.py --repeat 10 --max-seconds "$sweep" \
  --log "$out/sweep.log")
echo "== GPU check"
(cd "$root/build/gpu-bundle" && bash gpu_check.sh "$out" "$check")
