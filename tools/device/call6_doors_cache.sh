#!/bin/bash
# Device call 6 (same warm machine, after calls 1 and 2, and call 3 once for the gw2 wheels): the text doors and the
# class simulation (issues 36 and 38) against `serve --workers W --phrase-cache marked` with its own `vllm serve`,
# from client processes on the same host: `gateway.benchmarks.text_doors --gateway-url` (first audio and first words
# through the Cartesia WebSocket, WebRTC and SSE, N utterances at once) and `gateway.benchmarks.class_sim
# --gateway-url` (a class following one lesson, cache off then on in each class size's own voice).
# carry: .devcarry/snap, and .devcarry/gw2 + .devcarry/pool the first time (tools/device/README.md)
# env: NAME (output folder, doors_cache), SNAP (snap), WORKERS (8), SERVE_ARGS (extra gateway flags, "--max-num-seqs
#      512"), TOKENS_PER_CHAR (6), READY_TIMEOUT (s, 300), MPS, SERVE_CPUS / CLIENT_CPUS (taskset lists),
#      RUN ("doors class": either or both, in that order),
#      DOORS_ARGS (text_doors flags, "--concurrency 1,64 --utterances 16": 16 one at a time, one round of 64),
#      DOORS_TIMEOUT (s, 180), CLASS_ARGS (class_sim flags, "--students 64,128"), CLASS_TIMEOUT (s, 240):
#      start + both fit a 600 s call; KEEP=1: the workers stay up for the next call (workers.sh), which reuses
#      them with its own RUN and CLASS_ARGS (the cache directory and MPS daemon too: each class size has its own voice)
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; SNAP=${SNAP:-snap}
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
[ -d $DC/$SNAP/gateway ] && SRC=$DC/$SNAP
cd $SRC
T0=$(date +%s); OUT=${OUT:-/tmp/out}; NAME=${NAME:-doors_cache}; WORKERS=${WORKERS:-8}; mkdir -p $OUT/$NAME
RUN=${RUN:-doors class}; SERVE_ARGS=${SERVE_ARGS:---max-num-seqs 512}
[ -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ] || { echo "vLLM part B missing: run calls 1 and 2 first"; exit 3; }
if ls $DC/gw2/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/av ]; then  # carry .devcarry/gw2 unless call 3 ran
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site $DC/gw2/*.whl
fi
[ -d /tmp/site/av ] || { echo "gateway wheels missing: carry .devcarry/gw2"; exit 3; }
export PYTHONPATH=/tmp/site:$SRC VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ORPHEUS_GATEWAY_WORKER_SOCKETS=/tmp/gw-sockets
source $REPO/tools/device/workers.sh  # from the carried tree: an older SNAP may lack it
KEPT=""; [ -n "$KEEP" ] && workers_running && KEPT=1
[ -z "$KEPT" ] && rm -rf /tmp/gw-sockets /tmp/phrases && mkdir -p /tmp/gw-sockets
PORT=8800
if [ -d $DC/pool ]; then
  python3 tools/device/serve_deps.py $DC/pool /tmp/site || exit 4
fi
GRAPHS=""; [ -f /tmp/snac_graphs_bad ] && GRAPHS="--no-snac-cuda-graphs"
source tools/device/mps.sh; [ -z "$KEPT" ] && mps_start
SERVE_ARGS="--phrase-cache marked --phrase-cache-dir /tmp/phrases $SERVE_ARGS"  # a fresh cache each call
workers_start
RC=$?
echo "workers ready rc=$RC after $(( $(date +%s) - T0 ))s"
PIN=""; [ -n "$CLIENT_CPUS" ] && PIN="taskset -c $CLIENT_CPUS"
FILTER="^\(EngineCore|Capturing CUDA|Warning|warn|^INFO|^\s*$"
if [ $RC -eq 0 ] && [[ " $RUN " == *" doors "* ]]; then
  timeout ${DOORS_TIMEOUT:-180} $PIN python3 -m gateway.benchmarks.text_doors --gateway-url http://127.0.0.1:$PORT \
    --json $OUT/$NAME/text_doors.json ${DOORS_ARGS:---concurrency 1,64 --utterances 16} > $OUT/$NAME/doors.log 2>&1
  echo "doors rc=$? at $(( $(date +%s) - T0 ))s"
  grep -vE "$FILTER" $OUT/$NAME/doors.log | tail -c 4000
fi
if [ $RC -eq 0 ] && [[ " $RUN " == *" class "* ]]; then
  timeout ${CLASS_TIMEOUT:-240} $PIN python3 -m gateway.benchmarks.class_sim --gateway-url http://127.0.0.1:$PORT \
    --json $OUT/$NAME/class_sim.json ${CLASS_ARGS:---students 64,128} > $OUT/$NAME/class.log 2>&1
  echo "class rc=$? at $(( $(date +%s) - T0 ))s"
  grep -vE "$FILTER" $OUT/$NAME/class.log | tail -c 5000
fi
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=5).read().decode())" \
  2>&1 | grep -E "^orpheus_(phrase_cache|rejections|audio_tokens)" > $OUT/$NAME/metrics_end.txt
workers_stop
[ -z "$KEEP" ] && mps_stop
grep -vE "Capturing CUDA|^\s*$" $OUT/$NAME/serve.log | tail -c 2500
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "call6 total $(( $(date +%s) - T0 ))s"
