#!/usr/bin/env bash
# Prepared GPU run of the allocation sweep (`engram experiment allocation --scale gpu`), for a lent
# GPU machine (one H200). Not run yet: docs/results.md says so until its numbers are recorded there.
#
# Scale: hidden 512, 12 layers, DeepSeekMoE with 16 routed experts (top-2, width 256) and a shared
# expert (width 512), Engram at blocks 1 and 6; 5 allocation points (rho 100, 85.7, 78.6, 64.3, 50%),
# 1 seed, 3,100 steps x 64 x 512 = 101.6M tokens per variant (Shakespeare + KJV, ~2.1M train tokens:
# ~48 epochs). Total and activated parameters fixed (101.8M / 35.8M); the accounting is printed first.
# Fitting 10 minutes needs ~850k tokens/s over the 5 variants: unmeasured. The sweep is resumable:
# run the same command again and finished variants are skipped, interrupted ones resumed. Extra
# arguments go to `engram experiment` (e.g. `--max-steps 1500` for a shorter sweep).
# Checked on the CPU: every variant's config builds (tests/test_allocation.py), the 78.6% point trains.
#
# The device machine reaches no network, so prepare the token files here first and carry them:
#   ENGRAM_CACHE_DIR=$PWD/runs/cache engram data prepare --data shakespeare --data kjv --tokenizer bpe:4096
# then run this script with carry ["runs/cache"] (and ["runs/experiments"] to resume an earlier call).
set -euo pipefail
export ENGRAM_CACHE_DIR="${ENGRAM_CACHE_DIR:-$PWD/runs/cache}" PYTHONUNBUFFERED=1
OUT="${OUT:-runs}"
python -m pip install -q -e '.[fast,hf]' >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p runs/experiments
start=$(date +%s)
engram experiment allocation --scale gpu --seeds 1 --out runs/experiments "$@" 2>&1 | grep -v "it/s]" | tee "$OUT/allocation_gpu.log"
echo "wall seconds: $(( $(date +%s) - start ))"
cp runs/experiments/allocation-gpu/summary.* runs/experiments/allocation-gpu/accounting.json \
   runs/experiments/allocation-gpu/plot.png "$OUT/" 2>/dev/null || true
