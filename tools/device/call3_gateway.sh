#!/bin/bash
# Device call 3+ (same warm machine, after calls 1 and 2): the gateway's own benchmark on the Orpheus-shaped model.
# carry: .devcarry/gw2 (first time only: av + cryptography wheels)
# env:   NAME (output folder under $OUT), BENCH_ARGS (gateway.benchmarks.run flags: levels, scenarios, sweeps, engine settings),
#        MPS (non-empty: run under an NVIDIA MPS daemon, stopped at the end; a user-space daemon, no GPU setting)
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; SNAP=${SNAP:-snap}  # SNAP: a committed tree (git archive HEAD), or another
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
[ -d $DC/$SNAP/gateway ] && SRC=$DC/$SNAP  # commit's beside it for an A/B in one lease
cd $SRC  # python -m puts the working directory first on sys.path
T0=$(date +%s); OUT=${OUT:-/tmp/out}; NAME=${NAME:-gateway}; mkdir -p $OUT/$NAME
[ -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ] || { echo "vLLM part B missing: run calls 1 and 2 first"; exit 3; }
if ls $DC/gw2/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/av ]; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site $DC/gw2/*.whl
fi
export PYTHONPATH=/tmp/site:$SRC VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import aiortc, av, gateway.rtc.session, gateway.benchmarks.run; print('imports ok, aiortc', aiortc.__version__, 'av', av.__version__)" || exit 4
GRAPHS=""
[ -f /tmp/snac_graphs_bad ] && GRAPHS="--no-snac-cuda-graphs"
source tools/device/mps.sh; mps_start
echo "=== gateway.benchmarks.run $GRAPHS $BENCH_ARGS"
timeout ${BENCH_TIMEOUT:-560} python3 -m gateway.benchmarks.run --random-orpheus /tmp/orpheus-struct --out $OUT/$NAME $GRAPHS $BENCH_ARGS \
  > $OUT/$NAME/bench.log 2>&1
echo "bench rc=$?"
mps_stop
grep -vE "^\(EngineCore|Capturing CUDA|Warning|warn|^INFO|^\s*$" $OUT/$NAME/bench.log | tail -c 9000
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "call3 total $(( $(date +%s) - T0 ))s"
