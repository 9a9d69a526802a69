"""Which model a run uses: the real checkpoints, the tiny test model, or a random Orpheus-3B-shaped one.

Also the engine settings each choice implies (only where the command line did not set them) and the model's
shape for the report.
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


def engine_config(args: argparse.Namespace, choice: ModelChoice) -> GatewayConfig:
    """The GatewayConfig: the model choice's defaults, overridden by any engine flag given."""
    implied = {**choice.engine_defaults, "model": choice.model, "snac_model": choice.snac_model}
    overrides = {key: value for key, value in implied.items()
                 if value is not None and getattr(args, key, None) is None}
    return from_sources(args, env={}, **overrides)


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

