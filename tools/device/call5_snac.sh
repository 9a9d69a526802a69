#!/bin/bash
# Device call (after call 1): SNAC alone, windows against the exact stream, and the bridge's graphs against eager
# (tools/device/snac_stream_bench.py); then, with PROFILE, where a 256-stream bfloat16 step's GPU time goes
# (tools/device/snac_profile.py). carry: .devcarry/snap
# env: DTYPES (float32,bfloat16), SNAC_ARGS (extra flags, e.g. "--stream-variants eager,compiled"),
#      PROFILE (variants to profile, e.g. windows,stream,stream-compiled; none by default), NAME (snac_stream)
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; [ -d $DC/snap/gateway ] && SRC=$DC/snap  # snap: a committed tree
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
cd $SRC
T0=$(date +%s); OUT=${OUT:-/tmp/out}; NAME=${NAME:-snac_stream}; mkdir -p $OUT
[ -d /tmp/site/snac ] || { echo "snac missing: run call 1 first"; exit 3; }
export PYTHONPATH=/tmp/site:$SRC PYTHONUNBUFFERED=1
timeout ${BENCH_TIMEOUT:-420} python3 tools/device/snac_stream_bench.py --out $OUT/$NAME.json \
  --batches 64,256,512 --dtypes ${DTYPES:-float32,bfloat16} $SNAC_ARGS > $OUT/$NAME.log 2>&1
RC=$?; echo "snac bench rc=$RC"
# rc 1: the graphed stream differs from SNAC.decode: the gateway runs of this lease go without SNAC graphs
[ $RC -eq 1 ] && { echo "SNAC graphs differ: later calls run with --no-snac-cuda-graphs"; touch /tmp/snac_graphs_bad; }
tail -c 5000 $OUT/$NAME.log
if [ -n "$PROFILE" ]; then
  timeout ${PROFILE_TIMEOUT:-150} python3 tools/device/snac_profile.py --out $OUT/${NAME}_profile.json --batch 256 \
    --dtype bfloat16 --variants $PROFILE > $OUT/${NAME}_profile.log 2>&1
  echo "profile rc=$?"
  grep -v Warning $OUT/${NAME}_profile.log | tail -c 3000
fi
echo "call5 total $(( $(date +%s) - T0 ))s"
