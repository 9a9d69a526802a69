"""Which model a run uses: the real checkpoints, the tiny test model, or a random Orpheus-3B-shaped one.

Also the engine settings each choice implies (only where the command line did not set them), the model table of
`--models 2` / `--lora-voice` (a models file: the same checkpoint under a second name and language, a LoRA adapter
voice built if absent), and the model's shape for the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.benchmarks.timing import ORPHEUS_TOKENS_PER_CHAR
from gateway.config import GatewayConfig, from_sources

# Fastest start on a 2-core CPU (as tests/conftest.py's tiny_config).
TINY_ENGINE: dict[str, Any] = dict(
    snac_device="cpu", enforce_eager=True, max_model_len=1024, max_num_seqs=64, dtype="float32",
    warmup_batch_sizes=[2])
TINY_KV_CACHE_GIB = "1"  # vLLM CPU reserves 4 GiB of KV cache by default; the tiny model needs far less
TINY_MAX_TOKENS = 140  # 20 frames, 1.7 s of audio a sentence: the tiny model never stops, so every sentence is alike
RANDOM_SHAPE = "orpheus-3b"
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "torch_dtype")


@dataclass(frozen=True)
class ModelChoice:
    model: str | None  # None: whatever --model says (default: the real checkpoint)
    snac_model: str | None
    engine_defaults: dict[str, Any]
    tokens_per_char: float  # default budget rule: random weights never stop on their own
    kind: str  # "checkpoint", "tiny" or "random-orpheus"


@contextlib.contextmanager
def chosen_model(args: argparse.Namespace) -> Iterator[ModelChoice]:
    """Build the model the flags ask for (a temp dir lives as long as the context)."""
    if args.tiny:
        with tempfile.TemporaryDirectory(prefix="orpheus-bench-tiny-") as tmp:
            yield _tiny(Path(tmp))
    elif args.random_orpheus is not None:
        yield _random_orpheus(args.random_orpheus)
    else:
        yield ModelChoice(None, None, {}, 0.0, "checkpoint")


def _tiny(root: Path) -> ModelChoice:
    from gateway.devtools.devmodels import build_test_model, build_test_snac

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", TINY_KV_CACHE_GIB)  # read by the engine process
    model = build_test_model(root / "model", shape="tiny", stop_probability=0.0)
    snac = build_test_snac(root / "snac")
    return ModelChoice(str(model), str(snac), dict(TINY_ENGINE), ORPHEUS_TOKENS_PER_CHAR, "tiny")


def _random_orpheus(root: Path) -> ModelChoice:
    """Build once (several GB of bf16 weights), reuse on later runs."""
    from gateway.devtools.devmodels import build_test_model, build_test_snac

    if not (root / "config.json").exists():
        print(f"building a random {RANDOM_SHAPE} model in {root} (once) ...", flush=True)
        build_test_model(root, shape=RANDOM_SHAPE, stop_probability=0.0)
    snac = root / "snac"
    if not (snac / "config.json").exists():
        build_test_snac(snac)
    return ModelChoice(str(root), str(snac), {}, ORPHEUS_TOKENS_PER_CHAR, "random-orpheus")


def engine_config(args: argparse.Namespace, choice: ModelChoice, models_file: str | None = None) -> GatewayConfig:
    """The GatewayConfig: the model choice's defaults, overridden by any engine flag given; `models_file` (the
    benchmark's own table, `bench_models_file`) serves several models."""
    implied = {**choice.engine_defaults, "model": choice.model, "snac_model": choice.snac_model,
               "models_file": models_file}
    overrides = {key: value for key, value in implied.items()
                 if value is not None and getattr(args, key, None) is None}
    return from_sources(args, env={}, **overrides)


# The benchmark's table: each model one voice and language (the voice routes a stream to its model), and the LoRA
# voice on the first model.
BENCH_MODELS = (("en", "tara", "en-US"), ("pt", "ana", "pt-BR"))
BENCH_LORA_VOICE = "tutor"


def bench_models_file(args: argparse.Namespace, choice: ModelChoice, model: str, folder: Path) -> str | None:
    """A models file for `--models 2` and/or `--lora-voice` (None: neither, today's one model): `model` served under
    each name of BENCH_MODELS (a second engine of the same checkpoint speaking a second language, each with its
    even share of the GPU memory), the adapter (`--lora-voice DIR`, built there if absent; no DIR: beside a
    tiny/random model) on the first."""
    if args.models <= 1 and args.lora_voice is None:
        return None
    if getattr(args, "models_file", None) or "=" in str(getattr(args, "model", None) or ""):
        raise ValueError("--models/--lora-voice build the benchmark's own table: drop --models-file/--model NAME=PATH")
    lines = []
    for name, voice, language in BENCH_MODELS[:args.models]:
        lines += [f"[models.{name}]", f"path = {json.dumps(model)}", f'voices = ["{voice}"]',
                  f'languages = ["{language}"]', ""]
    if args.lora_voice is not None:
        adapter = lora_adapter(args.lora_voice, choice, model, args.lora_rank)
        lines += [f"[loras.{BENCH_LORA_VOICE}]", f"path = {json.dumps(str(adapter))}",
                  f'base = "{BENCH_MODELS[0][0]}"', f'voices = ["{BENCH_LORA_VOICE}"]', ""]
    path = folder / "models.toml"
    path.write_text("\n".join(lines))
    return str(path)


def lora_adapter(given: str, choice: ModelChoice, model: str, rank: int) -> Path:
    """The adapter directory of `--lora-voice`: a PEFT adapter there, built (random weights, every attention and MLP
    projection, rank `rank`) where none is."""
    import torch

    from gateway.devtools.devmodels import ALL_LORA_TARGETS, build_test_lora

    if given:
        folder = Path(given)
    elif choice.kind in ("tiny", "random-orpheus"):
        folder = Path(model).parent / f"{Path(model).name}-lora-r{rank}"
    else:
        raise ValueError("--lora-voice needs ADAPTER_DIR with a checkpoint (a random adapter is built beside "
                         "--tiny/--random-orpheus models only)")
    if not (folder / "adapter_config.json").exists():
        shape = "tiny" if choice.kind == "tiny" else RANDOM_SHAPE
        dtype = torch.float32 if shape == "tiny" else torch.bfloat16
        print(f"building a random rank-{rank} LoRA adapter ({shape}) in {folder} ...", flush=True)
        build_test_lora(folder, shape, rank=rank, targets=ALL_LORA_TARGETS, dtype=dtype)
    return folder



def model_shape(model: str) -> dict[str, Any] | None:
    """Llama dimensions from the model's config.json (a local dir, or the HF cache/hub); None if unknown."""
    raw = _read_model_config(model)
    if raw is None:
        return None
    shape = {key: raw.get(key) for key in SHAPE_KEYS}
    devmodel = Path(model) / "devmodel.json"
    if devmodel.exists():
        shape["devmodel"] = json.loads(devmodel.read_text())
    return shape


def _read_model_config(model: str) -> dict[str, Any] | None:
    local = Path(model) / "config.json"
    if local.exists():
        return json.loads(local.read_text())
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception:  # offline or unknown id: the report just lacks the shape
        return None


def tiny_fixed_length_config(root: Path, max_num_seqs: int, **overrides: Any) -> GatewayConfig:
    """The tiny random model and SNAC built under `root`, served on loopback with the fastest CPU engine settings;
    every sentence runs `TINY_MAX_TOKENS` (the model never stops itself). The single-purpose benchmarks' model."""
    from gateway.devtools.devmodels import build_test_model, build_test_snac

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", TINY_KV_CACHE_GIB)
    model = build_test_model(root / "model", shape="tiny", stop_probability=0.0)
    values: dict[str, Any] = {**TINY_ENGINE, "warmup_batch_sizes": [1], "max_num_seqs": max_num_seqs,
                              "max_tokens": TINY_MAX_TOKENS, "gc_freeze": False, "host": "127.0.0.1", "port": 0}
    values.update(overrides)
    return from_sources(env={}, model=str(model), snac_model=str(build_test_snac(root / "snac")), **values)
