"""Build an `AgentConfig` from defaults, a YAML/JSON file, environment variables and command-line flags.

One walk over the dataclass fields does everything: it converts and checks values (errors name the field and
the bad value), it adds one argparse flag per field that declares one (so `--help` lists them all), and it
reads the environment variables the fields declare. The caller turns `ConfigError` into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.config import model, nvidia_env, nvidia_file
from agent.config.bounded_parse import MAX_DEPTH, Refused, nesting_depth, parse
from agent.config.fields import floored
from agent.config.files import read_regular
from agent.config.numbers import NumberError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")
MAX_FILE_BYTES = 1 << 20
MIN_SECONDS = 0.01  # the floor of every `*_seconds` setting (interval, timeout, window): 10 ms


class ConfigError(ValueError):
    """An invalid config file, environment variable or flag value; the message names the field."""


def snake_case(key: str) -> str:
    """`resourceName` -> `resource_name`; snake_case keys pass through."""
    return _CAMEL.sub("_", key).lower() if "_" not in key else key.lower()


def camel_case(name: str) -> str:
    """`resource_name` -> `resourceName` (how fields are spelled in config files)."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # once per class: get_type_hints per list item was most of the 19,000-entry file's time (read-only result)
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _convert(value: Any, hint: Any, where: str) -> Any:
    """Convert a file/env/flag value to the field's type, or raise ConfigError naming `where`."""
    hint, optional = _unwrap_optional(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required, got null")
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_mapping(hint, value, where)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_convert(k, key_hint, where): _convert(v, value_hint, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {'an integer' if hint is int else 'a number'}, "
                              f"got {value!r}") from None
        if hint is int and isinstance(value, float) and value != number:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported setting type {hint!r}")  # a bug in model.py, not user input


def _yaml_switch(value: Any, f: dataclasses.Field) -> Any:
    """YAML 1.1 reads a bare `on`/`off` (and yes/no, true/false) as a boolean: for a setting whose choices are
    `on`/`off`, take the boolean as the word the operator wrote (`nodeLabels.mode: off`, `nodeLabels.gfd: on`)."""
    choices = f.metadata.get("choices") or ()
    if isinstance(value, bool) and ("on" if value else "off") in choices:
        return "on" if value else "off"
    return value


def _check_choices(f: dataclasses.Field, value: Any, where: str) -> None:
    choices = f.metadata.get("choices")
    if choices and value is not None and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    timed = f.name.endswith("_seconds") and isinstance(value, (int, float)) and not isinstance(value, bool)
    if timed and (value < 0 or (value == 0 and not f.metadata.get("zero_ok"))):
        allowed = "0 or more" if f.metadata.get("zero_ok") else "positive"
        raise ConfigError(f"{where}: must be {allowed}, got {value!r}")
    if timed and 0 < value < MIN_SECONDS:  # 1e-9 passed "positive" and spun a core at 76-97 %
        allowed = f"0 (off) or at least {MIN_SECONDS}" if f.metadata.get("zero_ok") else f"at least {MIN_SECONDS}"
        raise ConfigError(f"{where}: must be {allowed} seconds (the floor of every duration), got {value!r}")


def from_mapping(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Instantiate dataclass `cls` from a mapping with camelCase or snake_case keys."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = snake_case(str(key))
        path = f"{where}.{key}" if where else str(key)
        if name not in fields:
            known = ", ".join(camel_case(n) for n in fields)
            raise ConfigError(f"{path}: unknown setting (known here: {known})")
        values[name] = _convert(_yaml_switch(raw, fields[name]), hints[name], path)
        _check_choices(fields[name], values[name], path)
        values[name] = floored(fields[name], values[name], path)
    instance = cls(**values)
    check = getattr(instance, "check", None)
    if callable(check):
        try:
            check()
        except ValueError as exc:
            raise ConfigError(f"{where or 'config'}: {exc}") from exc
    return instance


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON config file (JSON is YAML); an empty file is an empty mapping.

    Bounded while parsing: size (MAX_FILE_BYTES, checked before reading), UTF-8, depth (MAX_DEPTH), YAML alias
    expansion (MAX_NODES) and integer digits; any of them is a ConfigError naming the file.
    """
    try:
        raw = read_regular(path, MAX_FILE_BYTES)  # never waits on a FIFO
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"config file {path}: more than {MAX_FILE_BYTES} bytes is more than a config file "
                          f"({MAX_FILE_BYTES})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    kind = "JSON" if str(path).endswith(".json") else "YAML"
    try:
        data = parse(text, kind)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: not valid {kind}: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"config file {path}: nested more deeply than any config ({MAX_DEPTH} levels)") from None
    except (Refused, NumberError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except (ValueError, ArithmeticError) as exc:  # e.g. a number beyond int's digit limit in a date or float
        raise ConfigError(f"config file {path}: a value cannot be read: {str(exc)[:120]}") from None
    if nesting_depth(data) > MAX_DEPTH:
        raise ConfigError(f"config file {path}: nested more deeply than any config ({MAX_DEPTH} levels)")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class _Flagged:
    path: tuple[str, ...]  # field names from AgentConfig down to the field
    field: dataclasses.Field
    hint: Any


def _flagged_fields(cls: type, path: tuple[str, ...] = ()) -> list[_Flagged]:
    found: list[_Flagged] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint, _ = _unwrap_optional(hints[f.name])
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            found.extend(_flagged_fields(hint, (*path, f.name)))
        elif f.metadata.get("flag") or f.metadata.get("env"):
            found.append(_Flagged((*path, f.name), f, hints[f.name]))
    return found


def _dest(path: tuple[str, ...]) -> str:
    return "cfg__" + "__".join(path)


def add_flags(parser: argparse.ArgumentParser, cls: type = model.AgentConfig,
              sections: tuple[str, ...] | None = None) -> None:
    """Add one flag per flagged setting (only under `sections` when given); values stay raw strings."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML or JSON config file (env GPU_NODE_AGENT_CONFIG)")
    for item in _flagged_fields(cls):
        flag = item.field.metadata.get("flag")
        if not flag or (sections is not None and item.path[0] not in sections):
            continue
        env = item.field.metadata.get("env")
        default = item.field.default if item.field.default is not dataclasses.MISSING else None
        bits = [item.field.metadata["help"]]
        if item.field.metadata.get("choices"):
            bits.append(f"one of: {', '.join(item.field.metadata['choices'])}")
        if default not in (None, "", False):
            bits.append(f"default: {default}")
        if env:
            bits.append(f"env {env}")
        text = "; ".join(bits)
        hint, _ = _unwrap_optional(item.hint)
        if hint is bool:
            parser.add_argument(flag, dest=_dest(item.path), action=argparse.BooleanOptionalAction,
                                default=None, help=text)
        elif item.field.metadata.get("repeat"):
            parser.add_argument(flag, dest=_dest(item.path), action="append", default=None, metavar="VALUE",
                                help=text + " (repeatable)")
        else:
            parser.add_argument(flag, dest=_dest(item.path), default=None,
                                metavar=flag.lstrip("-").upper().replace("-", "_"), help=text)


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        data = data.setdefault(camel_case(name), {})
    data[camel_case(path[-1])] = value


def _normalise_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """camelCase every key so that file, env and flag values merge into one mapping."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        out[camel_case(snake_case(str(key)))] = _normalise_keys(value) if isinstance(value, Mapping) else value
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def load(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
         cls: type = model.AgentConfig) -> Any:
    """Defaults < config file < environment < flags. Raises ConfigError on any invalid value. NVIDIA device
    plugin's environment names are read as aliases of the agent's (`nvidia_env`)."""
    try:
        env = nvidia_env.translate(env or {})
    except nvidia_env.NvidiaEnvError as exc:
        raise ConfigError(str(exc)) from None
    config_path = getattr(args, "config", None) or env.get("GPU_NODE_AGENT_CONFIG")
    merged: dict[str, Any] = _normalise_keys(read_file(config_path)) if config_path else {}
    env_values: dict[str, Any] = {}
    flag_values: dict[str, Any] = {}
    for item in _flagged_fields(cls):
        env_name = item.field.metadata.get("env")
        if env_name and env.get(env_name, "") != "":
            _set_path(env_values, item.path, env[env_name])
        raw = getattr(args, _dest(item.path), None) if args is not None else None
        if raw is not None:
            _set_path(flag_values, item.path, raw)
    _merge(merged, env_values)
    _merge(merged, flag_values)
    return from_mapping(cls, _merge(_nvidia_layer(merged, cls), merged))


def _nvidia_layer(merged: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """The settings NVIDIA's config file gives (`devicePlugin.nvidiaDpConfig`), the lowest layer: NVIDIA's own
    precedence puts its file below its environment and flags (`nvidia_file`)."""
    section = merged.get("devicePlugin")
    path = section.get("nvidiaDpConfig") if isinstance(section, Mapping) else None
    if not path or not isinstance(path, str):
        return {}
    try:
        layer = nvidia_file.translate(read_file(path), path)
    except nvidia_file.NvidiaConfigError as exc:
        raise ConfigError(f"NVIDIA device plugin config {path}: {exc}") from None
    values: dict[str, Any] = {}
    for item in _flagged_fields(cls):
        env_name = item.field.metadata.get("env")
        if env_name in layer.env:
            _set_path(values, item.path, layer.env[env_name])
    if layer.time_slicing is not None:
        values.setdefault("devicePlugin", {})["timeSlicing"] = layer.time_slicing
    return values


def to_mapping(obj: Any) -> Any:
    """The config as plain data with camelCase keys (for `config --dump` and logs)."""
    if dataclasses.is_dataclass(obj):
        return {camel_case(f.name): to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_mapping(item) for item in obj]
    return obj
