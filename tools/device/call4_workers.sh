#!/bin/bash
# Device call 4+ (same warm machine, after calls 1 and 2, and call 3 once for the gw2 wheels): the production
# layout, `serve --workers W` with its own `vllm serve`, measured by `gateway.benchmarks.run --gateway-url` from K client
# processes on the same host.
# carry: .devcarry/snap, and .devcarry/gw2 + .devcarry/pool the first time (tools/device/README.md)
# env: NAME (output folder), SNAP (snap: the .devcarry tree to run), WORKERS (8), SERVE_ARGS (extra gateway flags), BENCH_ARGS (gateway.benchmarks.run flags),
#      READY_TIMEOUT (s, 300), BENCH_TIMEOUT (s, 420),
#      TOKENS_PER_CHAR (the gateway's --max-tokens-per-char, 6: the random-weight model never stops by itself, and
#      without a cap every sentence ran to --max-tokens, 30-40 s of audio: H200, 2026-12-05 late, 0 of 256 real time),
#      MPS (non-empty: under an NVIDIA MPS daemon, tools/device/mps.sh),
#      FAULT_ARGS (gateway.benchmarks.faults flags: run the fault injection instead of gateway.benchmarks.run, e.g. "--peers 256"),
#      BENCH_ARGS2 (a second gateway.benchmarks.run on the same workers, into $NAME/second: saves their 80-150 s start),
#      SERVE_CPUS / CLIENT_CPUS / CLIENT_CPUS2 (taskset lists, e.g. 0-9 / 10-15: the gateway's processes, the first and
#      the second gateway.benchmarks.run's with their client processes, on cores of their own)
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; SNAP=${SNAP:-snap}  # SNAP: a committed tree (git archive), or another
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
[ -d $DC/$SNAP/gateway ] && SRC=$DC/$SNAP  # commit's beside it for an A/B in one lease
cd $SRC
T0=$(date +%s); OUT=${OUT:-/tmp/out}; NAME=${NAME:-workers}; WORKERS=${WORKERS:-8}; mkdir -p $OUT/$NAME
[ -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ] || { echo "vLLM part B missing: run calls 1 and 2 first"; exit 3; }
if ls $DC/gw2/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/av ]; then  # carry .devcarry/gw2 unless call 3 ran
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site $DC/gw2/*.whl
fi
[ -d /tmp/site/av ] || { echo "gateway wheels missing: carry .devcarry/gw2"; exit 3; }
export PYTHONPATH=/tmp/site:$SRC VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ORPHEUS_GATEWAY_WORKER_SOCKETS=/tmp/gw-sockets
rm -rf /tmp/gw-sockets && mkdir -p /tmp/gw-sockets
PORT=8800
if [ -d $DC/pool ]; then  # carry .devcarry/pool (wheels): what `vllm serve` imports beyond the slim tree
  python3 tools/device/serve_deps.py $DC/pool /tmp/site || exit 4
fi
GRAPHS=""; [ -f /tmp/snac_graphs_bad ] && GRAPHS="--no-snac-cuda-graphs"
source tools/device/mps.sh; mps_start
PIN1=""; [ -n "$CLIENT_CPUS" ] && PIN1="taskset -c $CLIENT_CPUS"
PIN2=""; [ -n "$CLIENT_CPUS2" ] && PIN2="taskset -c $CLIENT_CPUS2"
source $REPO/tools/device/workers.sh; workers_start  # from the carried tree: an older SNAP may lack it
RC=$?
echo "workers ready rc=$RC after $(( $(date +%s) - T0 ))s"
if [ $RC -eq 0 ] && [ -n "$FAULT_ARGS" ]; then
  timeout ${BENCH_TIMEOUT:-420} python3 -m gateway.benchmarks.faults --gateway-url http://127.0.0.1:$PORT --supervisor-pid $SERVE_PID \
    --sockets /tmp/gw-sockets --workers $WORKERS --out $OUT/$NAME $FAULT_ARGS > $OUT/$NAME/faults.log 2>&1
  echo "faults rc=$?"
  grep -E "^\[|^\|" $OUT/$NAME/faults.log | tail -c 7000
elif [ $RC -eq 0 ]; then
  timeout ${BENCH_TIMEOUT:-420} $PIN1 python3 -m gateway.benchmarks.run --gateway-url http://127.0.0.1:$PORT --gateway-pid $SERVE_PID \
    --out $OUT/$NAME $BENCH_ARGS \
    > $OUT/$NAME/bench.log 2>&1
  echo "bench rc=$?"
  grep -vE "^\(EngineCore|Capturing CUDA|Warning|warn|^INFO|^\s*$" $OUT/$NAME/bench.log | tail -c 7000
  if [ -n "$BENCH_ARGS2" ]; then
    mkdir -p $OUT/$NAME/second
    timeout ${BENCH_TIMEOUT2:-300} $PIN2 python3 -m gateway.benchmarks.run --gateway-url http://127.0.0.1:$PORT --gateway-pid $SERVE_PID \
      --out $OUT/$NAME/second $BENCH_ARGS2 > $OUT/$NAME/second/bench.log 2>&1
    echo "bench 2 rc=$?"
    grep -vE "^\(EngineCore|Capturing CUDA|Warning|warn|^INFO|^\s*$" $OUT/$NAME/second/bench.log | tail -c 5000
  fi
fi
workers_stop
mps_stop
grep -vE "Capturing CUDA|^\s*$" $OUT/$NAME/serve.log | tail -c 3000
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "call4 total $(( $(date +%s) - T0 ))s"
