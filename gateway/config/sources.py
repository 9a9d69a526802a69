"""The sources of the settings: one CLI flag and one environment variable per field; a field's default < its
variable < its flag < an explicit override."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any

from gateway.config.checks import validate
from gateway.config.rules import ConfigError
from gateway.config.settings import GatewayConfig
from gateway.model_table import ModelTableError, parse_model_flag

ENV_PREFIX = "ORPHEUS_GATEWAY_"


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, is_list) of a field annotation such as `int | None`, `list[str]` or `tuple[str, ...]`."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp, False


def _parse_scalar(tp: type, text: str) -> Any:
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    if text.strip().lower() in ("", "none", "null"):
        return None
    return tp(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are left None so env and dataclass defaults can apply."""
    hints = typing.get_type_hints(GatewayConfig)
    for f in dataclasses.fields(GatewayConfig):
        if f.metadata.get("internal"):
            continue
        tp, is_list = _base_type(hints[f.name])
        is_list = is_list or "repeatable" in f.metadata
        flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        env = ENV_PREFIX + f.name.upper()
        help_text = f"{f.metadata['help']} [default: {default!r}; env {env}]"
        # A field with its own flag shows that name in usage lines too (--vllm-url VLLM_URL).
        named = {"metavar": f.metadata["flag"].replace("-", "_").upper()} if "flag" in f.metadata else {}
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif is_list:
            parser.add_argument(flag, dest=f.name, action="append", type=tp, default=None, help=help_text, **named)
        else:
            parser.add_argument(flag, dest=f.name, type=lambda s, tp=tp: _parse_scalar(tp, s), default=None,
                                help=help_text, **named)


def from_sources(args: argparse.Namespace | None = None, env: dict[str, str] | None = None,
                 **overrides: Any) -> GatewayConfig:
    """Build the config: dataclass default < environment variable < CLI flag < explicit override."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(GatewayConfig)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GatewayConfig):
        if f.metadata.get("internal"):
            continue
        tp, is_list = _base_type(hints[f.name])
        is_list = is_list or "repeatable" in f.metadata
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            try:
                if is_list:
                    values[f.name] = [_parse_scalar(tp, part.strip()) for part in raw.split(",") if part.strip()]
                else:
                    values[f.name] = _parse_scalar(tp, raw)
            except ValueError as exc:
                raise ConfigError(f"{ENV_PREFIX + f.name.upper()}: {exc}") from exc
        cli = getattr(args, f.name, None) if args is not None else None
        if cli is not None:
            values[f.name] = cli
    values.update(overrides)
    for f in dataclasses.fields(GatewayConfig):
        if "repeatable" in f.metadata and isinstance(values.get(f.name), list):
            values[f.name], values[f.metadata["repeatable"]] = _split_entries(values[f.name])
    for f in dataclasses.fields(GatewayConfig):
        if typing.get_origin(hints[f.name]) is tuple and values.get(f.name) is not None:
            values[f.name] = tuple(values[f.name])  # flags and env give lists; tuple fields stay hashable, immutable
    config = GatewayConfig(**values)
    validate(config)
    return config


def _split_entries(items: list[str]) -> tuple[str, list[str]]:
    """--model's values: one plain PATH (today's one model, no entries), or NAME=PATH entries (the first entry's
    path is `model`: its tokenizer, the default voice's model)."""
    if len(items) == 1 and "=" not in items[0]:
        return items[0], []
    try:
        return parse_model_flag(items[0])[1], items
    except ModelTableError as exc:
        raise ConfigError(str(exc)) from None
