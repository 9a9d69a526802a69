#!/bin/bash
# Device call (after call 1): SNAC alone, windows against the exact stream, and the bridge's graphs against eager
# (bench/device/snac_stream_bench.py). carry: .devcarry/snap
# env: SNAC_ARGS (extra flags, e.g. "--snake compiled"), NAME (output name, snac_stream)
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; [ -d $DC/snap/gateway ] && SRC=$DC/snap  # snap: a committed tree
cd $SRC
T0=$(date +%s); OUT=${OUT:-/tmp/out}; NAME=${NAME:-snac_stream}; mkdir -p $OUT
[ -d /tmp/site/snac ] || { echo "snac missing: run call 1 first"; exit 3; }
export PYTHONPATH=/tmp/site:$SRC PYTHONUNBUFFERED=1
timeout ${BENCH_TIMEOUT:-540} python3 bench/device/snac_stream_bench.py --out $OUT/$NAME.json \
  --batches 64,256,512 --dtypes float32,bfloat16 $SNAC_ARGS > $OUT/$NAME.log 2>&1
echo "snac bench rc=$?"
tail -c 6000 $OUT/$NAME.log
echo "call5 total $(( $(date +%s) - T0 ))s"
