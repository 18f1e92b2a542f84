#!/bin/bash
# One device call for a session lent a GPU (the CUDA issue's order): the sweep first, then the GPU
# check, each under its own time budget. Prepare here: `make gpu-session` (build/gpu-bundle with
# its wheels, build/gpu-sweep without: it imports the runtime the bundle unpacks), then run on the
# device with both folders carried:
#   bash bench/gpu_session.sh OUT_DIR [SWEEP_SECONDS] [CHECK_SECONDS] [MMA_SECONDS]
# (130 + 240 + 90 s of cases by default: a device call is at most 600 s, the probe and the cases
# that run past their budget included)
# OUT_DIR gets sweep-mma.log (the hand-written mma lowering's candidates, checked and timed first),
# sweep.log (the fused lowering's), probe.log and cases.log.
out=${1:-${OUT:-.}}; sweep=${2:-130}; check=${3:-240}; mma=${4:-90}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 "$root/build/gpu-bundle/gpu_runner.py" --only no-such-case > /dev/null   # unpacks the bundle's wheels
export PYTHONPATH="$root/build/gpu-bundle/deps${PYTHONPATH:+:$PYTHONPATH}"
echo "== sweep of the mma lowering (at most ${mma} s of cases)"
(cd "$root/build/gpu-sweep" && timeout $((mma + 60)) python3 gpu_runner.py --repeat 10 --max-seconds "$mma" \
  --only -mma- --log "$out/sweep-mma.log")
echo "== sweep of the fused lowering (at most ${sweep} s of cases)"
(cd "$root/build/gpu-sweep" && timeout $((sweep + 90)) python3 gpu_runner.py --repeat 10 --max-seconds "$sweep" \
  --exclude -mma- --log "$out/sweep.log")
echo "== GPU check"
(cd "$root/build/gpu-bundle" && bash gpu_check.sh "$out" "$check")
