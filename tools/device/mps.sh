# Sourced by call3/call4: with MPS non-empty, run the call's processes under an NVIDIA MPS daemon (the engine's and
# SNAC's kernels side by side instead of time-sliced between two CUDA contexts). A user-space daemon, its pipe and
# log folders under /tmp, stopped at the end of the call (mps_stop); no GPU setting is changed.
mps_start() {
  [ -z "$MPS" ] && return 0
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS daemon started"
  else
    echo "MPS asked for but nvidia-cuda-mps-control is missing: running without"; MPS=""
  fi
}
mps_stop() {
  [ -n "$MPS" ] && { echo quit | nvidia-cuda-mps-control; echo "MPS daemon stopped"; }
  return 0
}
