"""Where the model, tokenizer and SNAC come from: a local folder, the Hugging Face cache, or the hub. Checked
before anything loads (`require_checkpoints`: everything a configuration loads), so a start-up that cannot succeed
says why in one line instead of retrying and tracing."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.speech.errors import CheckpointNotFoundError

HUB_CHECK_TIMEOUT_S = 5.0  # one quick question to the hub; its client would otherwise retry for a long while
MAKE_TEST_MODEL_HINT = "or build a random-weight one with `orpheus-gateway make-test-model DIR --snac`"


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def require_checkpoint(name_or_path: str, what: str, flag: str) -> None:
    """Pass when `name_or_path` is a local folder, a hub id in the local cache, or one the hub has; otherwise
    `CheckpointNotFoundError` saying what was looked for and what to do."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    if not _looks_like_hub_id(name_or_path) or path.exists():
        raise CheckpointNotFoundError(f"{what} {name_or_path!r}: no such folder; give {flag} PATH, "
                                      f"{MAKE_TEST_MODEL_HINT}")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        reason = _hub_has(name_or_path)
        if reason is None:
            return
    raise CheckpointNotFoundError(f"{what} {name_or_path!r} is not a local folder, not in the Hugging Face cache, "
                                  f"and not to be had from the hub ({reason}): give {flag} PATH, "
                                  f"{MAKE_TEST_MODEL_HINT}")


def _hub_has(repo_id: str) -> str | None:
    """None when the hub answers that it has `repo_id`; else why not, in a few words."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=HUB_CHECK_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; a token (HF_TOKEN) decides whether it downloads, and says so itself
    except RepositoryNotFoundError:
        return "the hub has no such repository"
    except Exception as exc:  # no network, DNS, proxy, timeout: all mean the same to the operator
        return f"hub unreachable: {type(exc).__name__}"
    return None


def require_checkpoints(config: GatewayConfig) -> None:
    """Everything this configuration loads is there (or to be had): one clear line otherwise."""
    if config.tokenizer:
        require_checkpoint(config.tokenizer, "tokenizer", "--tokenizer")
    for name, spec in config.model_table.models.items():
        if spec.lora_of is not None:
            require_checkpoint(spec.path, f"LoRA adapter {name!r}", "--lora or [loras] in --models-file")
            continue
        what = "model" if not config.model_table.several else f"model {name!r}"
        if config.tokenizer:
            pass
        elif not (config.vllm_urls or spec.vllm_urls):
            require_checkpoint(spec.path, what, "--model")
        else:  # the servers have the weights; the tokenizer still comes from --model here
            require_checkpoint(spec.path, f"{what} (its tokenizer)", "--model or --tokenizer")
    if not config.snac_socket:
        require_checkpoint(config.snac_model, "SNAC codec", "--snac-model")
