#!/bin/bash
# Device call 7 (same warm machine, after calls 1 and 2): issue 37's several-models benchmark, three engine-level runs
# of gateway.benchmarks.run on the Orpheus-shaped model in /tmp/orpheus-struct, back to back in one call:
#   alone: one engine (the whole GPU share), `traffic` at TRAFFIC_USERS total streams, all on it;
#   two:   two engines of that checkpoint in one process (en, pt), each with a KV cache of KV_GIB (vLLM sizes a
#          cache from the device's free memory, which the other engine changes while both start at once: an explicit
#          size per engine is each one's share), `traffic` at the same totals split 50/50 and 80/20, and
#          `mixed-spans` at 1 and 64 users (an EN line quoting a PT span: underruns at the two span boundaries);
#   lora:  one engine with a random rank-LORA_RANK adapter of every attention and MLP projection (built beside the
#          model if absent), LORA_USERS streams on the base voice, then as many on the adapter's voice.
# Real-time streams per model at 0 and 500 ms come from the same points (the stall check's two views). Sizes fit the
# 600 s limit on one H100 (each run's engine start included); a time limit keeps the points finished (JSON per point).
# Where the three do not fit (a slow host's engine starts), split them over two calls on the warm machine:
# RUNS="alone two", then RUNS=lora (same machine, so still the same run's figures).
# carry: .devcarry/gw2 (first time only), .devcarry/snap (committed code)
# env: NAME (output folder under $OUT), TRAFFIC_USERS (128,256), MIXED_USERS (1,64), LORA_USERS (128,256),
#      LORA_RANK (32), KV_GIB (20: the two run's KV cache per engine, ~180k tokens of the 3B shape),
#      BENCH_ARGS (more gateway.benchmarks.run flags for all three), RUNS ("alone two lora"),
#      T_ALONE / T_TWO / T_LORA (each run's timeout, s; all within CALL_S, 585; the first engine of a lease
#      starts in ~150 s, its compile caches cold: alone gets 240),
#      MPS (non-empty: under an NVIDIA MPS daemon, as call 3)
REPO=$(pwd); DC=$REPO/.devcarry; SRC=$REPO; SNAP=${SNAP:-snap}
source $REPO/tools/device/carried.sh  # folders from the stage calls (pack.py)
[ -d $DC/$SNAP/gateway ] && SRC=$DC/$SNAP
cd $SRC  # python -m puts the working directory first on sys.path
T0=$(date +%s); OUT=${OUT:-/tmp/out}; NAME=${NAME:-7_models}; mkdir -p $OUT/$NAME
[ -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ] || { echo "vLLM part B missing: run calls 1 and 2 first"; exit 3; }
[ -f /tmp/orpheus-struct/config.json ] || { echo "/tmp/orpheus-struct missing: run call 1 first"; exit 3; }
if ls $DC/gw2/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/av ]; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site $DC/gw2/*.whl
fi
export PYTHONPATH=/tmp/site:$SRC VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
GRAPHS=""
[ -f /tmp/snac_graphs_bad ] && GRAPHS="--no-snac-cuda-graphs"
TRAFFIC_USERS=${TRAFFIC_USERS:-128,256}; MIXED_USERS=${MIXED_USERS:-1,64}; LORA_USERS=${LORA_USERS:-128,256}
COMMON="--random-orpheus /tmp/orpheus-struct --level engine --listener-buffer-ms 0 --buffers-ms 0,500 --no-plots $GRAPHS"
source tools/device/mps.sh; mps_start
bench() {  # bench RUN TIMEOUT FLAGS...: one gateway.benchmarks.run into $OUT/$NAME/RUN
  local run=$1 limit=$2 left=$(( ${CALL_S:-585} - ($(date +%s) - T0) )); shift 2
  [ $left -lt $limit ] && limit=$left  # the call's own limit: the last run gets what is left, the summary still prints
  [ $limit -lt 60 ] && { echo "=== $run skipped: ${limit}s left"; return; }
  mkdir -p $OUT/$NAME/$run
  echo "=== $run (timeout ${limit}s): $*"
  timeout $limit python3 -m gateway.benchmarks.run $COMMON --out $OUT/$NAME/$run "$@" $BENCH_ARGS \
    > $OUT/$NAME/$run/bench.log 2>&1
  echo "$run rc=$? after $(( $(date +%s) - T0 ))s"
  awk '/^#### /{skip=1} /^### /{skip=0} !skip' $OUT/$NAME/$run/bench.log \
    | grep -E "^(###|\||\[bench\] (engine|wrote))|Error" | tail -c 5000  # the main tables, not "where the time went"
}
for RUN in ${RUNS:-alone two lora}; do
  case $RUN in
    alone) bench alone ${T_ALONE:-240} --models 1 --scenario traffic --traffic-users $TRAFFIC_USERS ;;
    two) bench two ${T_TWO:-230} --models 2 --kv-cache-memory-gib ${KV_GIB:-20} --scenario traffic,mixed-spans \
           --traffic 50/50,80/20 --traffic-users $TRAFFIC_USERS --mixed-spans-users $MIXED_USERS ;;
    lora) bench lora ${T_LORA:-180} --lora-voice --lora-rank ${LORA_RANK:-32} --scenario lora --lora-users $LORA_USERS ;;
  esac
done
mps_stop
echo "=== real-time streams per voice (model / adapter) and memory per engine"
python3 - $OUT/$NAME <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*/bench.json")):
    run = json.loads(path.read_text())
    for name, m in run.get("models", {}).get("memory", {}).get("engines", {}).items():
        print(f"{path.parent.name} engine {name}: share {m.get('gpu_memory_utilization')}, KV {m.get('blocks')} blocks "
              f"x {m.get('block_size')} = {m.get('tokens')} tokens, GPU {m.get('gpu_mib')} MiB")
    print(f"{path.parent.name} device: {run.get('models', {}).get('memory', {}).get('device')}")
    for entry in run["scenarios"]:
        for point in entry["points"]:
            s = point["summary"]
            voices = {v: x["realtime_streams"] for v, x in (s.get("by_voice") or {}).items()}
            spans = s.get("span_boundaries")
            print(f"{path.parent.name} {entry['scenario']} {entry.get('variant') or ''} N={point['users']}: "
                  f"ok {s['ok']}/{s['requests']}, real-time users @0/@500 {s['playback']['0']['realtime_users']}/"
                  f"{s['playback']['500']['realtime_users']}, per voice {voices}"
                  + (f", boundary underruns {spans['underruns']} of {spans['boundaries']}" if spans else ""))
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "call7 total $(( $(date +%s) - T0 ))s"
