"""The command line's engine flags, one per EngineConfig field, shared by `stepserve serve`,
`generate` (cluster/cli.py) and `profile` (sim/cli.py)."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping

from replica.config import EngineConfig

# The engine's flags are EngineConfig's fields (as vLLM's EngineArgs): --max-num-seqs for
# max_num_seqs, with its type, its Literal choices, its pydantic description as help, a bool as
# --x / --no-x. A flag left out keeps the config file's value (None: unset). A field added to
# EngineConfig gets its flag with no change here.
#
# Fields without a flag, and why (tests/cluster/test_cli_args.py checks every other field has one).
ENGINE_FLAGS_EXCLUDED: dict[str, str] = {
    "lora_modules": "a list: `stepserve serve --lora-modules name=path ...` (cluster/cli.py)",
}
# Extra spellings, kept from before the flags were generated.
ENGINE_FLAG_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("--tp",)}
# `serve` keeps its own flags of these names: repeatable, one per model (cluster/cli.py).
SERVE_OWN_FLAGS: dict[str, str] = {
    "model": "repeatable: --model A --model B serves both behind one endpoint",
    "served_model_name": "repeatable: one per --model, matched by position",
}
# `generate` keeps its own flags of these names: --seed seeds its one request's sampling.
GENERATE_OWN_FLAGS: dict[str, str] = {"seed": "the sampling seed of the one request"}
_ENGINE_DEST = "engine__"  # namespace attribute prefix: engine_field -> args.engine__field


def _engine_flag(name: str, field) -> tuple[list[str], dict]:
    """Option strings and add_argument keywords of one EngineConfig field."""
    flag = "--" + name.replace("_", "-")
    options = [flag, *ENGINE_FLAG_ALIASES.get(name, ())]
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    default = "unset" if field.default is None else field.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    help_text = (field.description or "").rstrip(".")
    help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
    kwargs: dict = {
        "dest": _ENGINE_DEST + name,
        "default": None,
        "help": help_text.replace("%", "%%"),
    }
    if annotation is bool:
        # enable_x also answers to --x / --no-x (stepserve's --no-prefix-caching)
        if name.startswith("enable_"):
            options.append("--" + name.removeprefix("enable_").replace("_", "-"))
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        kwargs.update(choices=list(choices), type=type(choices[0]))
    elif annotation in (int, float, str):
        kwargs.update(type=annotation, metavar=name.upper())
    else:
        raise TypeError(
            f"EngineConfig.{name} ({field.annotation}) has no command-line form: teach "
            "cluster/engine_args.py's _engine_flag its type, or list it in ENGINE_FLAGS_EXCLUDED"
        )
    return options, kwargs


def engine_flags(without: Mapping[str, str] = {}) -> dict[str, tuple[list[str], dict]]:
    """EngineConfig field -> (option strings, add_argument keywords), in field order."""
    return {
        name: _engine_flag(name, field)
        for name, field in EngineConfig.model_fields.items()
        if name not in ENGINE_FLAGS_EXCLUDED and name not in without
    }


def add_engine_args(p: argparse.ArgumentParser, without: Mapping[str, str] = {}) -> None:
    """The engine flags (`engine_flags`) as one argument group of `p`."""
    group = p.add_argument_group("engine (EngineConfig, replica/config.py)")
    for options, kwargs in engine_flags(without).values():
        group.add_argument(*options, **kwargs)


def engine_overrides(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (flags left out are not here)."""
    return {
        key.removeprefix(_ENGINE_DEST): value
        for key, value in vars(args).items()
        if key.startswith(_ENGINE_DEST) and value is not None
    }


def add_kv_transfer_args(parser: argparse.ArgumentParser, flag: str = "--kv-transfer") -> None:
    """The router's KV transfer switch (`flag`: `serve` calls it --kv-fetch, as --kv-transfer
    is the engine's export/import switch there) and --pd, for `serve` and `simulate`."""
    parser.add_argument(
        flag,
        dest="route_kv_transfer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the router fetches a prompt's cached prefix from the replica holding it when "
        "its cost model says that beats recomputing it (routing.kv_transfer)",
    )
    parser.add_argument(
        "--pd",
        metavar="PREFILL:DECODE",
        help="prefill/decode disaggregation with these replica counts, e.g. 1:3 (pd)",
    )
