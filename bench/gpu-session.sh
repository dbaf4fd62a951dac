#!/usr/bin/env bash
# What a session lent a GPU machine runs there, as one script (about 10 minutes on an H200): the offline install,
# the self-test, and the GPU figures the CPU cannot give (tokens/s, peak memory, the estimate's accuracy). Build the bundle here first, then carry it:
#   scripts/bundle -o kubetrain-bundle        (here, where the package index is reachable)
#   bench/gpu-session.sh kubetrain-bundle     (there; results go to $OUT, or ./gpu-results)
# Commit the JSON files under bench/results/ with the device and date in their names.
set -euo pipefail
bundle="${1:?usage: bench/gpu-session.sh BUNDLE_DIR}"
out="${OUT:-gpu-results}"
mkdir -p "$out"
target="$(mktemp -d)/kubetrain"
"$bundle/install" --target "$target" -- -o "$out/check.json" || echo "doctor --check: exit $? (see check.json)"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
python3 bench/bench_gpu_step.py --out "$out/gpu-step.json"
python3 bench/bench_loss.py --tokens 16384 --width 768 --vocab 50304 --out "$out/loss.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" || true
