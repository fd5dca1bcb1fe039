#!/usr/bin/env bash
# Issue 59's GPU measurements in one command, for a lent GPU machine (../shared/DEVICE.md):
# benchmarks/gpu.py (issue 41's table, eval.where, num_gpus_per_actor=auto, the bit-identity
# checks), then as many Fed2 speed points (configs/sweeps/fed2_speed_mnist.yaml) as fit
# FED2_SECONDS. Everything lands in $OUT as it goes (a killed step keeps what it wrote):
#   $OUT/results-gpu.txt, $OUT/fed2.tar.gz (the Fed2 points' folders), $OUT/nvidia-smi*.txt
#
#   bash benchmarks/gpu_session.sh          # on the GPU machine, with .dev carried
#   DRY=1 OUT=/tmp/dry bash benchmarks/gpu_session.sh   # CPU: tiny sizes, one Fed2 point of 1 round
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to an empty folder}
GPU_SECONDS=${GPU_SECONDS:-300}
FED2_SECONDS=${FED2_SECONDS:-180}
FED2_POINTS=${FED2_POINTS:-'epochs=1,k=3,.*seed=0 epochs=2,.*seed=0 epochs=5,.*seed=0'}
mkdir -p "$OUT"
if [ -d .dev/device-wheels ] && [ -z "${DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/device-wheels/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PY:-python3}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/session.log"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
MNIST=.dev/data/mnist-t10k
[ -d "$MNIST" ] || MNIST=../shared/data/mnist-t10k
$PY benchmarks/accuracy_mnist.py --mnist-dir "$MNIST" --write-split runs/data/mnist-split > "$OUT/split.txt" 2>&1
say "split written: $(tail -1 "$OUT/split.txt")"

say "benchmarks/gpu.py (at most ${GPU_SECONDS} s)"
if [ -n "${DRY:-}" ]; then
  timeout "$GPU_SECONDS" $PY benchmarks/gpu.py --dry --out "$OUT/results-gpu.txt" > "$OUT/gpu.log" 2>&1
else
  timeout "$GPU_SECONDS" $PY benchmarks/gpu.py --out "$OUT/results-gpu.txt" > "$OUT/gpu.log" 2>&1
fi
say "gpu.py exit $?"
nvidia-smi > "$OUT/nvidia-smi-after-gpu.txt" 2>&1 || true

say "Fed2 speed points (at most ${FED2_SECONDS} s): $FED2_POINTS"
only=()
for r in $FED2_POINTS; do only+=(--only "$r"); done
W=/tmp/w-fed2
extra=()
[ -n "${DRY:-}" ] && FED2_GPUS=0 && extra=(rounds=1 resources.num_actors=1) && only=(--only 'epochs=1,k=3,variant=fed2,seed=0')
(while sleep 20; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> "$OUT/gpu-util.txt" 2>/dev/null; done) &
watch=$!
timeout "$FED2_SECONDS" $PY benchmarks/sweep_processes.py --file configs/sweeps/fed2_speed_mnist.yaml --output-dir "$W" \
  --parallel "${FED2_PARALLEL:-6}" "${only[@]}" --python "$PY" ray.dashboard=false ray.object_store_gb=2 \
  checkpoint_every=0 resources.num_actors=2 resources.num_gpus_per_actor=${FED2_GPUS:-0.5} "${extra[@]}" \
  > "$OUT/fed2.log" 2>&1
say "fed2 sweep exit $?"
kill $watch 2>/dev/null
pkill -f "raysim.run" 2>/dev/null
tar czf "$OUT/fed2.tar.gz" -C "$W" . 2>/dev/null
say "done: $(ls "$OUT" | tr '\n' ' ')"
