#!/usr/bin/env bash
# Certify real engines on SmolLM2-135M-Instruct (Q4_1 GGUF), one code prompt with the chat template, temperature 1:
#   verispec  - verispec serve (prompt-lookup drafts, gamma 4) through its OpenAI API
#   verispec-llamacpp - the same on the llama.cpp runner (--runner llamacpp), against its own plain decoding
#   llamacpp  - llama.cpp's server (llama-cpp-python) plain, and with its prompt-lookup speculation against it
#   hf        - transformers' prompt-lookup decoding, in process
# Usage: run.sh [verispec] [llamacpp] [hf]   (default: all). Writes one folder per engine next to this script.
# Needs MODEL=path/to/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch-models.sh DIR smollm2) and, for llamacpp,
# pip install "llama-cpp-python[server]" (builds llama.cpp from source, ~10 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")"
MODEL=${MODEL:-$HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPTS=${PROMPTS:-code}
N=${N:-800}
N_LOOKUP=${N_LOOKUP:-400}  # llama-cpp-python serves one request at a time: the lookup run and its reference share it
STEPS=${*:-verispec verispec-llamacpp llamacpp hf}
SAMPLING=(--target "$MODEL" --prompts "$PROMPTS" --num-prompts 1 --chat --temperature 1 --samples "$N" --length 8)
COMMON=("${SAMPLING[@]}" --model smollm2 --max-in-flight 4)

wait_up() { for _ in $(seq 300); do curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }

if [[ " $STEPS " == *" verispec "* ]]; then  # exact tests, two-sample against verispec's own plain decoding
  verispec serve --target "$MODEL" --draft ngram --gamma 4 --threads 1 --port 8201 --served-model-name smollm2 &
  VS=$!
  wait_up http://127.0.0.1:8201
  verispec certify generate --method openai --base-url http://127.0.0.1:8201 "${COMMON[@]}" --out verispec-serve || true
  kill $VS; wait $VS || true
fi

if [[ " $STEPS " == *" verispec-llamacpp "* ]]; then  # the llama.cpp runner: its law is llama.cpp's, not fp32's
  SERVE=(verispec serve --target "$MODEL" --runner llamacpp --threads 1 --served-model-name smollm2)
  "${SERVE[@]}" --draft ngram --gamma 4 --port 8203 &
  VL=$!
  "${SERVE[@]}" --draft none --port 8204 &
  VP=$!
  wait_up http://127.0.0.1:8203 && wait_up http://127.0.0.1:8204
  # two-sample against plain decoding on the same runner (exact), and the fit to fp32 within TV 0.05
  verispec certify generate --method openai --base-url http://127.0.0.1:8203 "${COMMON[@]}" --max-in-flight 16 \
    --reference-url http://127.0.0.1:8204 --tv-tolerance 0.05 --out verispec-llamacpp-prompt-lookup || true
  kill $VL $VP; wait $VL $VP || true
fi

if [[ " $STEPS " == *" llamacpp "* ]]; then
  LLAMA=(python -m llama_cpp.server --model "$MODEL" --n_threads 1 --n_threads_batch 1 --logits_all true
         --model_alias smollm2)
  "${LLAMA[@]}" --port 8101 > llamacpp-plain.log 2>&1 &
  LP=$!
  "${LLAMA[@]}" --port 8102 --draft_model prompt-lookup --draft_model_num_pred_tokens 4 > llamacpp-lookup.log 2>&1 &
  LS=$!
  wait_up http://127.0.0.1:8101 && wait_up http://127.0.0.1:8102
  # plain: its fit to the float32 dequantized weights (exact tests) and its logprob parity
  verispec certify generate --method openai --base-url http://127.0.0.1:8101 "${COMMON[@]}" --two-sample-tokens 0 \
    --out llamacpp-plain || true
  # prompt lookup against plain, the same server's numerics: the exact two-sample test, and the fit within TV 0.05
  verispec certify generate --method openai --base-url http://127.0.0.1:8102 "${COMMON[@]}" --samples "$N_LOOKUP" \
    --reference-url http://127.0.0.1:8101 --tv-tolerance 0.05 --out llamacpp-prompt-lookup || true
  kill $LP $LS; wait $LP $LS || true
  rm -f llamacpp-plain.log llamacpp-lookup.log
fi

if [[ " $STEPS " == *" hf "* ]]; then  # exact tests, two-sample against verispec's plain decoding
  verispec certify generate --method hf-lookup --gamma 4 "${SAMPLING[@]}" --out hf-prompt-lookup || true
fi
