#!/usr/bin/env bash
# Prepared GPU check (run on a lent GPU machine from the repo root, ~4 minutes):
#  1. the CUDA paths of the tests (tables, model);
#  2. short CUDA training runs: tables as parameters, and tables in memory-mapped files (host side);
#  3. pinned-host Engram tables with side-stream prefetch vs on-device tables (bench_gpu_offload.py).
# Record the JSON line in docs/tables.md.
set -euo pipefail
OUT="${OUT:-.}"
python -m pip install -q -e '.[fast,hf,test]' >/dev/null
python -m pytest -q tests/test_tables.py tests/test_model.py -x
engram train --preset tiny --max-steps 20 --device cuda --out "$OUT/run_param" 2>&1 | tail -2
engram train --preset tiny --max-steps 20 --device cuda --table-mode mmap --out "$OUT/run_mmap" 2>&1 | tail -2
python -c "
import json, sys
a, b = ([json.loads(l)['train_loss'] for l in open(f'$OUT/{r}/metrics.jsonl')] for r in ('run_param', 'run_mmap'))
print('cuda ram vs mmap tables, max |loss diff| over 20 steps:', max(abs(x - y) for x, y in zip(a, b)))
"
python benchmarks/bench_gpu_offload.py "${1:-2000003}" | tee "$OUT/gpu_offload.txt"
