#!/usr/bin/env bash
# GRPO with TRL on SmolLM2-135M-Instruct (fp32), rollouts from verispec serve (prompt lookup drafts), 1 thread each.
# Usage: bash docs/rl/trl-smollm2/run.sh [MODEL.gguf]   (from the repository root; writes docs/rl/trl-smollm2/grpo.{json,md})
set -euo pipefail
MODEL=${1:-$HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}  # scripts/fetch-models.sh ~/models smollm2
PORT=8123
POLICY=${POLICY_DIR:-/tmp/verispec-smollm2-fp32}   # TRL trains transformers checkpoints: the GGUF file as fp32
[ -f "$POLICY/config.json" ] || python3 docs/rl/trl-smollm2/grpo.py --model "$MODEL" --convert-to "$POLICY"
verispec serve --target "$POLICY" --spec runner=fast --draft ngram --max-batch 16 --port $PORT --threads 1 \
    --enable-weight-updates &  # TRL pushes the policy after every step (off by default)
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
python3 docs/rl/trl-smollm2/grpo.py --server http://127.0.0.1:$PORT --model "$POLICY" \
    --prompts math --steps 3 --num-prompts 2 --num-generations 4 \
    --max-completion-length 48 --threads 1 --out docs/rl/trl-smollm2
