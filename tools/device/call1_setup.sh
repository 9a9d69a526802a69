#!/bin/bash
# Device call 1 of a GPU benchmark session (see tools/device/README.md).
# carry: .devcarry/cur1 .devcarry/bench .devcarry/gw1
# Unpacks vLLM (part A), installs the gateway's pure-Python deps, builds the Orpheus-shaped model.
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; [ -d $DC/snap/gateway ] && SRC=$DC/snap  # snap: a committed tree (git archive HEAD)
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
cd $SRC  # python -m puts the working directory first on sys.path
T0=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/site
( cd /tmp/site && tar -xJf $DC/cur1/siteA.tar.xz )
python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/site $DC/gw1/*.whl $DC/bench/snac-*.whl
echo "unpacked A + gateway deps in $(( $(date +%s) - T0 ))s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
# The host too: two machines with the same H100 differed 2x in the workers' CPU time (2026-12-06 midday)
lscpu | grep -E '^(Model name|CPU\(s\)|CPU max MHz|BogoMIPS|L3 cache)' | tee -a $OUT/gpu.txt
python3 -V; nproc; free -g | head -2
PYTHONPATH=/tmp/site python3 $DC/bench/check_imports.py aiohttp,numpy,transformers,tokenizers,safetensors,matplotlib,prometheus_client,psutil,cryptography,av,snac 2>&1 | tee $OUT/imports.log
if [ -z "$SKIP_MODEL" ]; then  # SKIP_MODEL=1: a lease that times SNAC alone (call 5) needs no model
  echo "=== model"
  PYTHONPATH=/tmp/site:$SRC timeout 300 python3 -m gateway.devtools.devmodels /tmp/orpheus-struct --shape orpheus-3b --stop-probability 0 --snac 2>&1 | tail -3
  du -sh /tmp/orpheus-struct
fi
echo "call1 total $(( $(date +%s) - T0 ))s"
# The gateway's own SNAC graphs (the exact stream's) are checked by call 5 (snac_stream_bench's `check`); the
# windows baseline's graphs only with SNAC_CHECK=1.
[ -z "$SNAC_CHECK" ] && exit 0
echo "=== SNAC preflight of the windows baseline (graphed == eager?)"
PYTHONPATH=/tmp/site:$SRC timeout 120 python3 $SRC/tools/device/snac_check.py /tmp/orpheus-struct/snac $OUT
echo "call1 with SNAC check $(( $(date +%s) - T0 ))s"
