#!/usr/bin/env bash
# The README's commands, as a new user runs them: a fresh venv, a clean clone of this checkout's HEAD, then every
# command of the README's shell blocks in order, verbatim, each one timed ("[readme] 12.3 s: COMMAND" on stderr).
# tests/test_docs.py checks that the README's commands are this script's commands, in order. `engram serve` runs
# in the foreground in the README; here it runs in the background (`serve_step`) until /health answers, then one
# request asks for the edited fact through the overlay, and the server is stopped.
#
#   bash scripts/readme_commands.sh [VENV] [WORKDIR]     (defaults /tmp/engram-readme-venv, /tmp/engram-readme)
#   README_SKIP_TESTS=1 bash scripts/readme_commands.sh  (leaves out the test-suite command, which CI runs as is)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/engram-readme-venv}"
WORK="${2:-/tmp/engram-readme}"
rm -rf "$VENV" "$WORK"
mkdir -p "$WORK"
git clone -q "$REPO" "$WORK/engram"
cd "$WORK/engram"
# a new user's caches start empty; the golden vectors are the project's (../shared/golden) when this checkout has them
export XDG_CACHE_HOME="$WORK/.cache"
unset ENGRAM_CACHE_DIR ENGRAM_BASES_DIR
[ -d "$REPO/../shared/golden" ] && export ENGRAM_GOLDEN_DIR="$REPO/../shared/golden"
python3 -m venv "$VENV"
. "$VENV/bin/activate"

step() {  # run one README command (a string, as the README shows it) and say how long it took
  local t0 t1
  t0=$(date +%s.%N)
  bash -c "$1"
  t1=$(date +%s.%N)
  printf '[readme] %.1f s: %s\n' "$(echo "$t1 - $t0" | bc)" "$1" >&2
}

serve_step() {  # a server command: started in the background, used once it answers, then stopped
  local t0 t1 pid
  t0=$(date +%s.%N)
  bash -c "$1" > serve.log 2>&1 &
  pid=$!
  until curl -sf localhost:8000/health > /dev/null; do
    kill -0 "$pid" 2> /dev/null || { cat serve.log >&2; exit 1; }
    sleep 1
  done
  curl -sf localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "cpu-small+ov1", "prompt": "The home of Braeethdor is", "max_tokens": 4, "temperature": 0}' >&2
  echo >&2
  kill "$pid"
  wait "$pid" || true
  t1=$(date +%s.%N)
  printf '[readme] %.1f s: %s\n' "$(echo "$t1 - $t0" | bc)" "$1" >&2
}

# --- the README's commands, verbatim (between the markers; tests/test_docs.py holds them equal to the README's) ---
# readme:begin
step "pip install torch --index-url https://download.pytorch.org/whl/cpu"
step "pip install -e '.[fast,hf]' && engram demo"
[ -n "${README_SKIP_TESTS:-}" ] || step "pip install -e '.[test]' && python -m pytest -q"
step "pip install -e '.[fast,train,serve]'"
step "engram train --preset cpu-small --out runs/cpu-small      # Ctrl-C finishes the step and checkpoints; --resume"
step "engram eval --checkpoint runs/cpu-small"
step "engram sample --checkpoint runs/cpu-small --prompt \"ROMEO. \""
step "echo '{\"prompt\": \"The home of Braeethdor is\", \"target\": \" Bohemia\"}' > facts.jsonl"
step "engram edit --checkpoint runs/cpu-small --facts facts.jsonl --out runs/edits/ov1   # a fact as an overlay"
serve_step "engram serve --checkpoint runs/cpu-small --overlay ov1=runs/edits/ov1   # OpenAI API: model cpu-small, or cpu-small+ov1 with the fact"
# readme:end
