"""The test models of gateway.devtools.devmodels: tokenizer, structured weights (checked with transformers, not
vLLM), stop calibration, the random SNAC and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from gateway.devtools import devmodels
from gateway.devtools.devmodels import (
    AUDIO_TOKEN_BASE,
    BOS_ID,
    CODEBOOK_SIZE,
    END_OF_HUMAN_ID,
    END_OF_SPEECH_ID,
    END_OF_TEXT_ID,
    REFERENCE_TEMPERATURE,
    REFERENCE_TOP_P,
    SLOTS_PER_FRAME,
    START_OF_AI_ID,
    START_OF_HUMAN_ID,
    START_OF_SPEECH_ID,
    VOCAB_SIZE,
    audio_slot,
    audio_token_id,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# snac's activations use torch.jit.script, which torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

STOP_PROBABILITY = 0.05
REPETITION_PENALTY = 1.1
SAMPLED_STEPS = 3 * SLOTS_PER_FRAME + 1
SNAC_FRAMES = 3
SNAC_SAMPLES_PER_FRAME = 2048
TEXTS = ["tara: Olá, coração! Não é fácil.", "유나: 안녕하세요, 반갑습니다.", "leo: plain ASCII <laugh> text"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and a SNAC under it, written through the CLI."""
    out = tmp_path_factory.mktemp("devmodel") / "tiny"
    devmodels.main([str(out), "--stop-probability", str(STOP_PROBABILITY), "--snac"])
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    # float32: torch's CPU bf16 matmuls are ~10x slower at these sizes.
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [START_OF_HUMAN_ID, BOS_ID, *ids, END_OF_TEXT_ID, END_OF_HUMAN_ID, START_OF_AI_ID, START_OF_SPEECH_ID]


def _next_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()


def _production_probs(logits: torch.Tensor, seen: list[int]) -> torch.Tensor:
    """vLLM's order: repetition penalty on prompt + output ids, temperature, then top-p (which drops the
    smallest tokens whose cumulative mass is <= 1 - top_p)."""
    logits = logits.clone()
    idx = torch.tensor(sorted(set(seen)))
    picked = logits[idx]
    logits[idx] = torch.where(picked > 0, picked / REPETITION_PENALTY, picked * REPETITION_PENALTY)
    probs = torch.softmax(logits / REFERENCE_TEMPERATURE, dim=-1)
    sorted_probs, order = probs.sort()
    drop = sorted_probs.cumsum(0) <= 1 - REFERENCE_TOP_P
    drop[-1] = False
    probs[order[drop]] = 0
    return probs / probs.sum()


def test_tokenizer_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.bos_token_id == BOS_ID
    assert tokenizer.eos_token_id == END_OF_TEXT_ID
    assert tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"]) == [
        BOS_ID, END_OF_TEXT_ID, 128_006]
    assert tokenizer.convert_ids_to_tokens([START_OF_SPEECH_ID, AUDIO_TOKEN_BASE, VOCAB_SIZE - 1]) == [
        "<custom_token_1>", "<custom_token_10>", "<custom_token_28683>"]
    # Llama 3 specials are matched in text; BOS is added by the post-processor.
    assert tokenizer.encode("<|eot_id|>", add_special_tokens=False) == [END_OF_TEXT_ID]
    assert tokenizer.encode("hi")[0] == BOS_ID


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_unicode(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # byte-level, no merges
    assert all(0 <= i < devmodels.LLAMA_BPE_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_config(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == VOCAB_SIZE
    assert config["tie_word_embeddings"] is False
    assert config["bos_token_id"] == BOS_ID
    assert END_OF_SPEECH_ID in config["eos_token_id"]
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] >= 64
    assert (model_dir / "generation_config.json").exists()
    assert json.loads((model_dir / "devmodel.json").read_text())["stop_probability"] == STOP_PROBABILITY


def test_greedy_next_tokens_follow_slot_order(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _prompt(tokenizer, TEXTS[0])
    for k in range(SLOTS_PER_FRAME - 1):
        token = int(_next_logits(model, ids).argmax())
        assert audio_slot(token) == k
        ids.append(token)
    # After slot 6 the stop id outranks each single code (that is how top-p keeps it).
    ids.append(audio_token_id(SLOTS_PER_FRAME - 1, 0))
    assert int(_next_logits(model, ids).argmax()) == END_OF_SPEECH_ID


def test_sampled_tokens_follow_slot_order(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    gen = torch.Generator().manual_seed(0)
    prompt = _prompt(tokenizer, TEXTS[1])
    ids = list(prompt)
    out: list[int] = []
    for _ in range(SAMPLED_STEPS):
        probs = _production_probs(_next_logits(model, ids), ids)
        token = int(torch.multinomial(probs, 1, generator=gen))
        if token == END_OF_SPEECH_ID:
            break
        out.append(token)
        ids.append(token)
    assert [audio_slot(t) for t in out] == [k % SLOTS_PER_FRAME for k in range(len(out))]
    assert len(out) >= SLOTS_PER_FRAME  # start of speech never stops: at least one frame
    codes = [(t - AUDIO_TOKEN_BASE) % CODEBOOK_SIZE for t in out]
    assert len(set(codes)) > len(codes) // 2


def test_stop_probability_per_frame(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _prompt(tokenizer, TEXTS[2])
    ids += [audio_token_id(k, k) for k in range(SLOTS_PER_FRAME)]
    probs = _production_probs(_next_logits(model, ids), ids)
    assert probs[END_OF_SPEECH_ID] == pytest.approx(STOP_PROBABILITY, rel=0.1)
    assert probs[AUDIO_TOKEN_BASE:AUDIO_TOKEN_BASE + CODEBOOK_SIZE].sum() == pytest.approx(
        1 - STOP_PROBABILITY, rel=0.01)
    # Mid-frame the stop id is cut.
    mid = _production_probs(_next_logits(model, ids[:-3]), ids[:-3])
    assert mid[END_OF_SPEECH_ID] == 0


def test_stop_logit_calibration() -> None:
    """The closed form behind the weights: kept stop mass / (top-p mass) = the asked probability."""
    for p in (0.005, 0.02, 0.2):
        stop = devmodels.stop_logit(p)
        scale = 1 / REFERENCE_TEMPERATURE
        pre = math.exp(stop * scale) / (math.exp(stop * scale) + CODEBOOK_SIZE * math.exp(
            devmodels.AUDIO_LOGIT * scale))
        assert pre / REFERENCE_TOP_P == pytest.approx(p)
    with pytest.raises(ValueError):
        devmodels.stop_logit(devmodels.MIN_STOP_PROBABILITY / 2)


def test_orpheus_3b_plan_without_building() -> None:
    """The 3B tensor plan has Orpheus's 3.78e9 parameters (Llama-3.2-3B with the audio vocabulary and an
    untied lm_head) and shards of bounded size."""
    shape = devmodels.SHAPES["orpheus-3b"]
    rand = devmodels._Randn(0, torch.bfloat16)
    plan = devmodels._tensor_plan(shape, torch.bfloat16, rand, 0.02)
    params = sum(math.prod(dims) for _, dims, _ in plan)
    assert params == 3_782_986_752
    assert ("model.layers.27.mlp.down_proj.weight", (3072, 8192)) in [(n, d) for n, d, _ in plan]
    shards = devmodels._shards(plan, itemsize=2)
    assert 2 <= len(shards) <= 8
    for shard in shards:
        assert sum(math.prod(d) * 2 for _, d, _ in shard) <= devmodels.MAX_SHARD_BYTES


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        devmodels.build_test_model(tmp_path, "huge")
    with pytest.raises(ValueError):
        devmodels.build_test_model(tmp_path, stop_probability=1.5)
    with pytest.raises(ValueError):
        devmodels.build_test_model(tmp_path, dtype="int8")


def test_snac_loads_and_decodes(model_dir: Path) -> None:
    from snac import SNAC

    codec = SNAC.from_pretrained(str(model_dir / "snac"))
    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(CODEBOOK_SIZE, (1, n * SNAC_FRAMES), generator=gen) for n in (1, 2, 4)]
    with torch.inference_mode():
        audio = codec.decode(codes)
    assert audio.shape == (1, 1, SNAC_SAMPLES_PER_FRAME * SNAC_FRAMES)
    assert torch.isfinite(audio).all()
    assert audio.abs().max() <= 1.0
