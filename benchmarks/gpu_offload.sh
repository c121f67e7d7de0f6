#!/usr/bin/env bash
# Prepared GPU check (run on a lent GPU machine from the repo root, ~3 minutes):
# pinned-host Engram tables with prefetch vs on-device tables. Record the JSON line in docs/tables.md.
set -euo pipefail
python -m pip install -q -e '.[fast,hf]' >/dev/null
python -m pytest -q tests/test_tables.py tests/test_model.py -x
python benchmarks/bench_gpu_offload.py "${1:-2000003}" | tee "${OUT:-.}/gpu_offload.txt"
