"""Small Orpheus-compatible models built on disk, for tests and benchmarks without the real weights.

`build_test_model` writes a Llama checkpoint with Orpheus's vocabulary, special ids and shape (a "tiny"
one for CPU tests, the exact 3B one for GPU benchmarks) whose weights are *structured* so that the real
model, run by the real vLLM engine with the production sampling settings, speaks Orpheus's output
grammar: audio ids in slot order (slot k mod 7), near-uniform codes, and the stop id only at frame
boundaries with a chosen probability per frame. Random weights would emit random ids and the audio
pipeline would get nothing to decode.

`build_test_snac` writes a random-weight SNAC 24 kHz codec that `snac.SNAC.from_pretrained` loads.

CLI: `python -m gateway.devtools.devmodels OUT_DIR [--shape tiny|orpheus-3b] [--stop-probability P] [--snac]`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# --- Orpheus ids (gateway/orpheus.py may later own these) -------------------------------------------
LLAMA_VOCAB_SIZE = 128_256  # Llama 3 ids: 128,000 BPE tokens + 256 special tokens
LLAMA_BPE_SIZE = 128_000
CUSTOM_TOKEN_COUNT = 28_684  # `<custom_token_N>` has id LLAMA_VOCAB_SIZE + N
VOCAB_SIZE = LLAMA_VOCAB_SIZE + CUSTOM_TOKEN_COUNT  # 156,940
# One home for Orpheus' ids: gateway/orpheus.py; re-exported here for the builders and their tests.
from gateway.orpheus import (  # noqa: E402, F401
    AUDIO_TOKEN_BASE,
    AUDIO_TOKEN_END,
    BOS_ID,
    CODEBOOK_SIZE,
    END_OF_HUMAN_ID,
    END_OF_SPEECH_ID,
    END_OF_TEXT_ID,
    SLOTS_PER_FRAME,
    START_OF_AI_ID,
    START_OF_HUMAN_ID,
    START_OF_SPEECH_ID,
    Frame,
    audio_token_id,
)

# Llama 3's named special tokens; the other ids in 128000..128255 are <|reserved_special_token_K|>.
LLAMA_NAMED_SPECIALS = {
    128_000: "<|begin_of_text|>",
    128_001: "<|end_of_text|>",
    128_004: "<|finetune_right_pad_id|>",
    128_006: "<|start_header_id|>",
    128_007: "<|end_header_id|>",
    128_008: "<|eom_id|>",
    128_009: "<|eot_id|>",
    128_010: "<|python_tag|>",
}

# --- production sampling the stop probability is calibrated for ------------------------------------
REFERENCE_TEMPERATURE = 0.6
REFERENCE_TOP_P = 0.8

# --- structured weights ------------------------------------------------------------------------------
# Hidden dimensions 0..6 mark "the current token is an audio id of slot j"; dimension 7 marks start of
# speech, which behaves like slot 6 (the next token is slot 0) except that it never leads to a stop, so
# every utterance has at least one frame.
SLOT_MARKER_DIM0 = 0
SOS_MARKER_DIM = SLOT_MARKER_DIM0 + SLOTS_PER_FRAME
MARKER_DIMS = SOS_MARKER_DIM + 1
# Logit of every id of the correct next slot. Every other id gets NEGATIVE_LOGIT, so even at temperature
# 1 without top-p nothing else is ever sampled (the margin, 24, is > ln(150,000) = 12 by far).
AUDIO_LOGIT = 8.0
NEGATIVE_LOGIT = -16.0
INIT_STD = 0.02  # N(0, 0.02): the usual Llama initializer range, for the weights that only add compute
RANDOM_POOL_SIZE = 1 << 24  # big random tensors tile a pool of this many normals (randn is the slow part)
MAX_SHARD_BYTES = 2 * 1024**3
WEIGHTS_FILE_MODE = 0o644
# A stop probability so small that the stop id is less likely than one audio code is cut by top-p.
MIN_STOP_PROBABILITY = 1.0 / (REFERENCE_TOP_P * CODEBOOK_SIZE)

ROPE_THETA = 500_000.0
LLAMA3_ROPE_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
MAX_POSITION_EMBEDDINGS = 131_072
CHECKPOINT_TRANSFORMERS_VERSION = "4.50.0"
RMS_NORM_EPS = 1e-5

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """Llama dimensions of a test model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    default_dtype: str


SHAPES: dict[str, ModelShape] = {
    # vLLM's CPU attention wants head_dim >= 64 (32 is listed in 0.32 but 64 is the safe minimum).
    "tiny": ModelShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64, default_dtype="bfloat16"),
    # canopylabs/orpheus-3b-0.1-ft = Llama-3.2-3B.
    "orpheus-3b": ModelShape(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                             num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                             default_dtype="bfloat16"),
}


def audio_slot(token_id: int) -> int | None:
    """Slot (0..6) of an audio id, None for any other id."""
    if AUDIO_TOKEN_BASE <= token_id < AUDIO_TOKEN_END:
        return (token_id - AUDIO_TOKEN_BASE) // CODEBOOK_SIZE
    return None


def stop_logit(stop_probability: float) -> float:
    """Logit after a slot-6 token that makes the stop id win with `stop_probability` per frame.

    Under temperature T and top-p P the stop id is more likely than any single audio code, so top-p keeps
    it and drops ~(1 - P) of the audio mass: the kept stop probability is p_pre / P, hence p_pre = P * p.
    Before top-p, p_pre = e^(S/T) / (e^(S/T) + 4096 e^(L/T)) (the other ids are ~0).
    """
    if not 0.0 < stop_probability < 1.0:
        raise ValueError("stop_probability must be in (0, 1)")
    if stop_probability < MIN_STOP_PROBABILITY:
        raise ValueError(f"stop_probability below {MIN_STOP_PROBABILITY:.1e} would be cut by top-p; use 0")
    pre = REFERENCE_TOP_P * stop_probability
    return AUDIO_LOGIT + REFERENCE_TEMPERATURE * math.log(CODEBOOK_SIZE * pre / (1.0 - pre))


# (tensor name, shape, factory): tensors are only made when their shard is written.
_PlanEntry = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


class _Randn:
    """N(0, std) tensors fast: small ones drawn directly, big ones tiled from one pool at a random offset
    (the values only need to make the compute real, not be independent)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._dtype = dtype
        self._pool: torch.Tensor | None = None

    def __call__(self, *shape: int, std: float = INIT_STD) -> torch.Tensor:
        numel = math.prod(shape)
        if numel <= RANDOM_POOL_SIZE:
            return (torch.randn(numel, generator=self._gen) * std).to(self._dtype).view(*shape)
        if self._pool is None:
            self._pool = torch.randn(RANDOM_POOL_SIZE, generator=self._gen).to(self._dtype)
        offset = int(torch.randint(RANDOM_POOL_SIZE, (1,), generator=self._gen))
        tiles = math.ceil((offset + numel) / RANDOM_POOL_SIZE)
        out = self._pool.repeat(tiles)[offset:offset + numel].clone()
        return out.mul_(std).view(*shape)


def _marker_scale(hidden_size: int) -> float:
    """Value of a marker dim after the final RMSNorm (weight 1) when the embedding is sqrt(H) * one-hot."""
    amplitude = math.sqrt(hidden_size)
    return amplitude / math.sqrt(amplitude**2 / hidden_size + RMS_NORM_EPS)


def _embed_tokens(shape: ModelShape, rand: _Randn) -> torch.Tensor:
    """Random small rows; audio ids and start of speech carry their context marker (sqrt(H) * one-hot)."""
    weight = rand(VOCAB_SIZE, shape.hidden_size)
    amplitude = math.sqrt(shape.hidden_size)
    audio = weight[AUDIO_TOKEN_BASE:AUDIO_TOKEN_END].view(SLOTS_PER_FRAME, CODEBOOK_SIZE, shape.hidden_size)
    audio.zero_()
    for slot in range(SLOTS_PER_FRAME):
        audio[slot, :, SLOT_MARKER_DIM0 + slot] = amplitude
    weight[START_OF_SPEECH_ID].zero_()
    weight[START_OF_SPEECH_ID, SOS_MARKER_DIM] = amplitude
    return weight


def _lm_head(shape: ModelShape, rand: _Randn, stop_probability: float) -> torch.Tensor:
    """Random rows outside the marker dims; on them, logit(context marker -> id) / marker value."""
    weight = rand(VOCAB_SIZE, shape.hidden_size)
    scale = _marker_scale(shape.hidden_size)
    markers = weight[:, :MARKER_DIMS]  # a view: (vocab, 8)
    markers.fill_(NEGATIVE_LOGIT / scale)
    audio = markers[AUDIO_TOKEN_BASE:AUDIO_TOKEN_END].view(SLOTS_PER_FRAME, CODEBOOK_SIZE, MARKER_DIMS)
    for slot in range(SLOTS_PER_FRAME):
        previous = (slot - 1) % SLOTS_PER_FRAME
        audio[slot, :, SLOT_MARKER_DIM0 + previous] = AUDIO_LOGIT / scale
    audio[0, :, SOS_MARKER_DIM] = AUDIO_LOGIT / scale
    if stop_probability > 0:
        markers[END_OF_SPEECH_ID, SLOT_MARKER_DIM0 + SLOTS_PER_FRAME - 1] = stop_logit(stop_probability) / scale
    return weight


def _tensor_plan(shape: ModelShape, dtype: torch.dtype, rand: _Randn, stop_probability: float
                 ) -> list[_PlanEntry]:
    """(name, shape, make) for every tensor, in file order; tensors are made lazily, one shard at a time."""
    h, i = shape.hidden_size, shape.intermediate_size
    q_out = shape.num_attention_heads * shape.head_dim
    kv_out = shape.num_key_value_heads * shape.head_dim

    def rnd(*dims: int) -> Callable[[], torch.Tensor]:
        return lambda: rand(*dims)

    def zeros(*dims: int) -> Callable[[], torch.Tensor]:
        return lambda: torch.zeros(*dims, dtype=dtype)

    def ones(*dims: int) -> Callable[[], torch.Tensor]:
        return lambda: torch.ones(*dims, dtype=dtype)

    plan: list[_PlanEntry] = [
        ("model.embed_tokens.weight", (VOCAB_SIZE, h), lambda: _embed_tokens(shape, rand)),
    ]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        plan += [
            (p + "input_layernorm.weight", (h,), ones(h)),
            (p + "self_attn.q_proj.weight", (q_out, h), rnd(q_out, h)),
            (p + "self_attn.k_proj.weight", (kv_out, h), rnd(kv_out, h)),
            (p + "self_attn.v_proj.weight", (kv_out, h), rnd(kv_out, h)),
            # Zero output projections keep the residual stream equal to the token embedding.
            (p + "self_attn.o_proj.weight", (h, q_out), zeros(h, q_out)),
            (p + "post_attention_layernorm.weight", (h,), ones(h)),
            (p + "mlp.gate_proj.weight", (i, h), rnd(i, h)),
            (p + "mlp.up_proj.weight", (i, h), rnd(i, h)),
            (p + "mlp.down_proj.weight", (h, i), zeros(h, i)),
        ]
    plan += [
        ("model.norm.weight", (h,), ones(h)),
        ("lm_head.weight", (VOCAB_SIZE, h), lambda: _lm_head(shape, rand, stop_probability)),
    ]
    return plan


def _shards(plan: list[_PlanEntry], itemsize: int) -> list[list[_PlanEntry]]:
    """Consecutive groups of at most MAX_SHARD_BYTES (a bigger tensor gets a shard of its own)."""
    shards: list[list[_PlanEntry]] = [[]]
    size = 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _write_weights(out: Path, shape: ModelShape, dtype: torch.dtype, seed: int, stop_probability: float
                   ) -> None:
    from safetensors.torch import save_file

    rand = _Randn(seed, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _shards(_tensor_plan(shape, dtype, rand, stop_probability), itemsize)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for name, shard in zip(names, shards, strict=True):
        tensors = {key: make().contiguous() for key, _, make in shard}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        (out / name).chmod(WEIGHTS_FILE_MODE)  # safetensors writes 0600; others may serve the files
        for key, tensor in tensors.items():
            weight_map[key] = name
            total += tensor.numel() * itemsize
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _model_config(shape: ModelShape, dtype: str) -> dict[str, Any]:
    """config.json in the form of canopylabs/orpheus-3b-0.1-ft (Llama 3.2, vocab 156,940)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": [END_OF_TEXT_ID, END_OF_SPEECH_ID],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_bias": False,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING),
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        # Like the real (transformers 4.x) checkpoint; without a version transformers 5 warns that the
        # tokenizer might be a Mistral one with a broken regex.
        "transformers_version": CHECKPOINT_TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


# --- tokenizer ---------------------------------------------------------------------------------------

def _byte_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet, in its order (printable bytes first, so "!" is id 0 as in Llama 3)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in printable] + [chars[b] for b in range(256) if b not in printable]


def token_names() -> list[str]:
    """Name of every id 0..VOCAB_SIZE-1: byte tokens, reserved fillers, Llama specials, custom tokens."""
    names = _byte_to_unicode()
    names += [f"<|reserved_bpe_{i}|>" for i in range(len(names), LLAMA_BPE_SIZE)]
    reserved = 0
    for token_id in range(LLAMA_BPE_SIZE, LLAMA_VOCAB_SIZE):
        if token_id in LLAMA_NAMED_SPECIALS:
            names.append(LLAMA_NAMED_SPECIALS[token_id])
        else:
            names.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    names += [f"<custom_token_{n}>" for n in range(CUSTOM_TOKEN_COUNT)]
    return names


def write_tokenizer(out_dir: str | Path) -> Path:
    """A byte-level BPE tokenizer (no merges: one id per UTF-8 byte) with Orpheus's 156,940 ids.

    Every id is in the model vocabulary, so nothing has to be matched as an added token except Llama's
    256 specials (28k added custom tokens would make loading slow); BOS is added by the post-processor
    as in Llama 3.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = token_names()
    vocab = {name: token_id for token_id, name in enumerate(names)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    bos = names[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, BOS_ID)])
    tokenizer.add_special_tokens([AddedToken(names[i], special=True, normalized=False)
                                  for i in range(LLAMA_BPE_SIZE, LLAMA_VOCAB_SIZE)])
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {"bos_token": bos, "eos_token": names[END_OF_TEXT_ID]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return out


# --- public builders ---------------------------------------------------------------------------------

def build_test_model(out_dir: str | Path, shape: str = "tiny", *, seed: int = 0, stop_probability: float = 0.02,
                     dtype: str | None = None) -> Path:
    """Write an Orpheus-compatible Llama checkpoint with structured weights that speak Orpheus's grammar.

    How: every layer's output projections (o_proj, down_proj) are zero, so the residual stream that reaches
    the final norm is the input embedding of the current token, whatever the (random, really computed)
    attention and MLP weights do. Each audio id's embedding is a one-hot "context marker" for its slot
    (start of speech gets a marker of its own), and lm_head turns marker j into a large logit for the ids of
    the next slot, a very negative one for every other id, and for marker 6 a stop logit tuned so that top-p
    sampling keeps it and it wins with the requested probability. Only the last token matters, so prompts
    are free-form.

    shape: "tiny" (CPU tests) or "orpheus-3b" (the real 3B shape); both bfloat16 by default (vLLM on CPU
    downcasts float32 checkpoints to bfloat16 anyway).
    stop_probability: chance of the stop id after each complete frame under temperature 0.6, top-p 0.8
    (0 = never stops). Greedy decoding always stops after the first frame when it is > 0.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    if stop_probability != 0:
        stop_logit(stop_probability)  # validate before the slow part
    dims = SHAPES[shape]
    dtype_name = dtype or dims.default_dtype
    if dtype_name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; choose from {sorted(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _write_weights(out, dims, DTYPES[dtype_name], seed, stop_probability)
    (out / "config.json").write_text(json.dumps(_model_config(dims, dtype_name), indent=2))
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [END_OF_TEXT_ID, END_OF_SPEECH_ID],
                  "do_sample": True, "temperature": REFERENCE_TEMPERATURE, "top_p": REFERENCE_TOP_P,
                  "repetition_penalty": 1.1}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(out)
    meta = {"shape": shape, **asdict(dims), "dtype": dtype_name, "seed": seed,
            "stop_probability": stop_probability, "build_seconds": round(time.monotonic() - started, 2),
            "note": "structured test weights written by gateway.devtools.devmodels; not a speech model"}
    (out / "devmodel.json").write_text(json.dumps(meta, indent=2))
    return out


SNAC_24KHZ_CONFIG: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": CODEBOOK_SIZE,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}


def random_frames(n: int, seed: int = 0) -> list[Frame]:
    """`n` Orpheus frames of random SNAC codes (7 codes in [0, 4096) each), the same for the same seed: what the
    tests and benches feed a random-weight SNAC."""
    rng = np.random.default_rng(seed)
    return [tuple(int(c) for c in rng.integers(0, CODEBOOK_SIZE, SLOTS_PER_FRAME))  # type: ignore[misc]
            for _ in range(n)]


LORA_TARGETS = ("q_proj", "v_proj")  # attention inputs only: o_proj is zero, so the model's grammar is kept
# Every attention and MLP projection of a Llama layer: the usual fine-tune's adapter (Unsloth/PEFT "all linear").
ALL_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that write the residual stream: their B stays zero (PEFT's own initial B), so the adapted model keeps
# Orpheus' grammar while vLLM runs the same LoRA kernels as for a trained adapter.
RESIDUAL_WRITERS = ("o_proj", "down_proj")
_LORA_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def build_test_lora(out_dir: str | Path, shape: str = "tiny", *, rank: int = 8, seed: int = 0,
                    targets: tuple[str, ...] = LORA_TARGETS, dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a `build_test_model` checkpoint
    of `shape`: random A and B on every layer's `targets` (default q_proj and v_proj), B zero on the projections
    that write the residual stream (`RESIDUAL_WRITERS`). What the others feed is multiplied by those zero weights
    in the structured model, so the adapted model still speaks Orpheus' grammar while vLLM runs the adapter's real
    multi-LoRA path."""
    from safetensors.torch import save_file

    unknown = sorted(set(targets) - set(_LORA_MODULE))
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {list(_LORA_MODULE)}")
    dims = SHAPES[shape]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rand = _Randn(seed, dtype)
    q_out, kv_out = dims.num_attention_heads * dims.head_dim, dims.num_key_value_heads * dims.head_dim
    h, i = dims.hidden_size, dims.intermediate_size
    in_out = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(dims.num_hidden_layers):
        for target in targets:
            prefix = f"base_model.model.model.layers.{layer}.{_LORA_MODULE[target]}.{target}"
            fan_in, fan_out = in_out[target]
            tensors[f"{prefix}.lora_A.weight"] = rand(rank, fan_in).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(fan_out, rank, dtype=dtype) \
                if target in RESIDUAL_WRITERS else rand(fan_out, rank).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets), "base_model_name_or_path":
              None, "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def build_test_snac(out_dir: str | Path, seed: int = 0) -> Path:
    """A random-weight SNAC with hubertsiuzdak/snac_24khz's config, as config.json + pytorch_model.bin.

    The encoder is kept: `SNAC.from_pretrained` loads the state dict strictly.
    """
    from snac import SNAC

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SNAC(**SNAC_24KHZ_CONFIG)
    (out / "config.json").write_text(json.dumps(SNAC_24KHZ_CONFIG, indent=2))
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def build_parser() -> argparse.ArgumentParser:
    """`make-test-model`'s arguments (also what the docs' command lines are checked against)."""
    parser = argparse.ArgumentParser(prog="python -m gateway.devtools.devmodels",
                                     description="Write a small Orpheus-compatible test model (and SNAC).")
    parser.add_argument("out_dir", type=Path)
    shapes_help = "; ".join(f"{name}: {dims.num_hidden_layers} layers, hidden {dims.hidden_size}"
                            for name, dims in SHAPES.items())
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help=shapes_help)
    parser.add_argument("--stop-probability", type=float, default=0.02,
                        help="chance of stopping after each frame (0 = never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the shape's")
    parser.add_argument("--snac", action="store_true", help="also write a random SNAC under OUT_DIR/snac")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    path = build_test_model(args.out_dir, args.shape, seed=args.seed, stop_probability=args.stop_probability,
                            dtype=args.dtype)
    print(f"model: {path} ({time.monotonic() - started:.1f} s)")
    if args.snac:
        print(f"snac: {build_test_snac(args.out_dir / 'snac', seed=args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
