#!/bin/bash
# Device call 8, alone on a fresh machine (no stage calls, no vLLM): SNAC's micro-benchmarks need only the card's
# torch + Triton, the snac wheel and einops. carry: .devcarry/snaconly (`cp .devcarry/bench/snac-*.whl
# .devcarry/snaconly/ && pip download --no-deps --only-binary=:all: -d .devcarry/snaconly einops`).
# Runs, each under its own limit: the four block heads three ways (cuDNN's transposed convolution, one polyphase
# product, the fused Triton head: snac_head_variants.py), the step with fused heads beside the step without them and
# the compiled one (snac_stream_bench.py, bfloat16), then what time is left on the heads' tile sweep.
# env: BATCHES (64,256,512), VARIANTS (kernels-heads,kernels,compiled), TIME_S (the step bench's limit, 300), END (the call's end for the sweep, s, 560)
python3 -m pip install -q --no-deps --no-index --target /tmp/site .devcarry/snaconly/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E 'Model name|^CPU\(s\)|BogoMIPS'
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
timeout 90 python3 tools/device/snac_head_variants.py --out $OUT/head_variants.json --batch 256 \
  > $OUT/head_variants.log 2>&1
echo "heads rc=$? $(( $(date +%s) - T0 ))s"; grep -v Warn $OUT/head_variants.log | tail -c 2000
timeout ${TIME_S:-300} python3 tools/device/snac_stream_bench.py --out $OUT/heads_step.json \
  --batches ${BATCHES:-64,256,512} --dtypes bfloat16 --no-check --stream-variants ${VARIANTS:-kernels-heads,kernels,compiled} \
  --repeats 20 > $OUT/heads_step.log 2>&1
echo "step rc=$? $(( $(date +%s) - T0 ))s"; grep -v Warn $OUT/heads_step.log | tail -c 3000
LEFT=$(( ${END:-560} - ($(date +%s) - T0) ))
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 tools/device/snac_head_variants.py --out $OUT/head_sweep.json --batch 256 --sweep \
    > $OUT/head_sweep.log 2>&1
  echo "sweep rc=$? $(( $(date +%s) - T0 ))s"; grep -v Warn $OUT/head_sweep.log | tail -c 2500
fi
