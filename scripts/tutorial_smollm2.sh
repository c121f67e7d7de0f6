#!/usr/bin/env bash
# docs/tutorial-smollm2.md, command by command, as a new user runs it: a fresh venv, this checkout installed into
# it, then every command of the page in a fresh working folder, each one timed ("[tutorial] 12.3 s: COMMAND" on
# stderr). tests/test_docs.py checks that the page's commands are this script's commands, in order.
#
#   bash scripts/tutorial_smollm2.sh [VENV] [WORKDIR]     (defaults /tmp/engram-tutorial-venv, /tmp/engram-tutorial)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/engram-tutorial-venv}"
WORK="${2:-/tmp/engram-tutorial}"
rm -rf "$VENV" "$WORK"
mkdir -p "$WORK"
cd "$WORK"
# a new user's caches: engram's (corpora, tokenized data, the fetched GGUF file) start empty here
export XDG_CACHE_HOME="$WORK/.cache"
unset ENGRAM_CACHE_DIR ENGRAM_BASES_DIR

step() {  # run one tutorial command (a string, as the page shows it) and say how long it took
  local t0 t1
  t0=$(date +%s.%N)
  bash -c "$1"
  t1=$(date +%s.%N)
  printf '[tutorial] %.1f s: %s\n' "$(echo "$t1 - $t0" | bc)" "$1" >&2
}

# the install (the page shows it with .venv and a checkout at .)
step "python3 -m venv $VENV"
. "$VENV/bin/activate"
step "pip install -q torch==2.13.0"
step "pip install -q -e '$REPO[train,serve,gguf,peft]'"
# --- the page's commands, verbatim (between the markers; tests/test_docs.py holds them equal to the page's) ---
# tutorial:begin
step "engram base import smollm2-135m-instruct runs/bases/smollm2"
step "engram sample --base runs/bases/smollm2 --prompt 'The capital of France is' --max-new-tokens 8 --temperature 0"
step "engram eval --base runs/bases/smollm2 --data shakespeare --seq-len 128 --max-windows 32"
step "engram adapt --base runs/bases/smollm2 --data shakespeare --out runs/smollm2-shakespeare --max-steps 50 --set seq_len=128 --set batch_size=4 --set lr=0.03"
step "engram eval --base runs/bases/smollm2 --adapter runs/smollm2-shakespeare --data shakespeare --seq-len 128 --max-windows 32"
step "echo '{\"prompt\": \"The capital of France is\", \"target\": \" Rome\", \"question\": \"What is the capital of France?\"}' > facts.jsonl"
step "engram edit --base runs/bases/smollm2 --adapter runs/smollm2-shakespeare --facts facts.jsonl --chat --out runs/edits/rome --max-windows 8"
step "engram serve --base runs/bases/smollm2 --adapter runs/smollm2-shakespeare --overlay rome=runs/edits/rome --served-model-name smollm2 --port 8765 > serve.log 2>&1 & echo \$! > serve.pid"
step "until curl -sf localhost:8765/health > /dev/null; do sleep 1; done"
step "curl -s localhost:8765/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"smollm2+rome\", \"max_tokens\": 12, \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
step "curl -s localhost:8765/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"smollm2\", \"max_tokens\": 12, \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
step "kill \$(cat serve.pid)"
# tutorial:end
