#!/bin/bash
# Device call 2: unpack vLLM part B, then the bare-vLLM baseline on the same model and card.
# carry: .devcarry/cur2 .devcarry/bench (or, split: call 2a `cp .devcarry/cur2a/* /tmp/` with cur2a, then this with
#        cur2b: tools/device/README.md)      env: BENCH_N, BENCH_N_SHORT, BENCH_DEADLINE as in call2.sh;
#        SKIP_BASELINE=1 only unpacks (the bench's own vllm level is the same-run ceiling)
REPO=$(pwd); DC=$REPO/.devcarry; T0=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p $OUT
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
[ -f /tmp/site/vllm/__init__.py ] || { echo "part A missing: run call 1 first (machine went back?)"; exit 3; }
if [ -f $DC/cur2/siteB.tar.xz ]; then
  ( cd /tmp/site && tar -xJf $DC/cur2/siteB.tar.xz )
else  # split in two (the tree and part B together pass 64 MiB): call 2a copied part aa to /tmp, this call has ab
  [ -f /tmp/siteB.part.aa ] || { echo "part B: carry .devcarry/cur2, or run call 2a (cur2a) first"; exit 3; }
  cat /tmp/siteB.part.aa $DC/cur2b/siteB.part.ab | ( cd /tmp/site && tar -xJ ) && rm /tmp/siteB.part.aa
fi
echo "unpacked B in $(( $(date +%s) - T0 ))s"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -n "$SKIP_BASELINE" ] && { echo "baseline skipped (SKIP_BASELINE)"; exit 0; }
timeout ${BENCH_TIMEOUT:-520} python3 $DC/bench/bench_vllm.py /tmp/orpheus-struct $OUT ${BENCH_DEADLINE:-450} > $OUT/vllm.log 2>&1
echo "bench rc=$?"
grep -vE "^\(EngineCore|Capturing CUDA|Warning|warn" $OUT/vllm.log | tail -c 5000
echo "call2 total $(( $(date +%s) - T0 ))s"
