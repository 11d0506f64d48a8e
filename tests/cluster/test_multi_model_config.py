"""Several models in one ClusterConfig: `models:` entries layered over the top-level fields,
one LLM deployment each, names unique across models and adapters, and the `stepserve serve`
flags that build them (no Ray started)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.app import deployment_name, ingress_settings, replica_options, thread_settings
from cluster.cli import build_config, make_parser, parse_lora_module
from cluster.config import ClusterConfig


def parse(*argv: str) -> ClusterConfig:
    return build_config(make_parser().parse_args(["serve", *argv]))


def two_models(**top) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            **top,
            "models": [
                {"engine": {"model": "/m/llama", "served_model_name": "a"}},
                {"engine": {"model": "/m/qwen", "served_model_name": "b"}, "replicas": 3},
            ],
        }
    )


def test_a_config_without_models_is_the_one_model_it_always_was():
    config = ClusterConfig.model_validate(
        {"engine": {"model": "/m/llama", "max_num_seqs": 8}, "replicas": 2}
    )
    (model,) = config.deployments()
    assert model.engine == config.engine and model.replicas == 2
    assert model.served_name() == config.model_name() == "llama"
    assert replica_options(config)["name"] == "LLMServer"  # as every existing config names it
    assert replica_options(config)["num_replicas"] == 2
    assert thread_settings(config)["replicas_per_machine"] == 2


def test_models_entries_take_the_top_level_fields_they_leave_out():
    config = two_models(engine={"max_num_seqs": 8}, replicas=2, num_cpus_per_replica=1.0)
    a, b = config.deployments()
    assert (a.served_name(), b.served_name()) == ("a", "b") and config.model_name() == "a"
    assert a.engine.max_num_seqs == b.engine.max_num_seqs == 8  # the top-level engine, layered
    assert (a.replicas, b.replicas) == (2, 3)  # b says its own
    assert a.num_cpus_per_replica == b.num_cpus_per_replica == 1.0


def test_each_model_is_a_deployment_of_its_own_and_threads_count_every_replica():
    config = two_models(replicas=2)
    a, b = config.deployments()
    names = [deployment_name(config, m) for m in (a, b)]
    assert names == ["LLMServer-a", "LLMServer-b"]
    assert replica_options(config, b)["num_replicas"] == 3
    assert replica_options(config, a)["num_replicas"] == 2
    # 2 + 3 replicas share one machine's cores: each model's auto thread count divides by 5
    assert thread_settings(config, b)["replicas_per_machine"] == 5
    settings = ingress_settings(config)
    assert [m.name for m in settings.models] == ["a", "b"] and settings.model_name == "a"


def test_autoscaled_models_count_their_max_replicas_on_the_machine():
    config = two_models(autoscaling={"enabled": True, "max_replicas": 4})
    assert config.replicas_per_machine() == 8
    assert (
        replica_options(config, config.deployments()[1])["autoscaling_config"]["max_replicas"] == 4
    )


def test_a_served_name_used_twice_is_refused_naming_it():
    with pytest.raises(ValidationError, match="served name 'a' is used twice"):
        ClusterConfig.model_validate(
            {"models": [{"engine": {"served_model_name": "a"}}, {"engine": {"model": "/x/a"}}]}
        )
    adapters = {"lora_modules": [{"name": "b", "path": "/adapters/b"}]}
    with pytest.raises(ValidationError, match="'b' is used twice: by the model and by the adapter"):
        ClusterConfig.model_validate(
            {
                "models": [
                    {"engine": {"model": "/m/b"}},
                    {"engine": {"model": "/m/c", **adapters}},
                ]
            }
        )
    with pytest.raises(ValidationError, match="'x' is used twice"):
        lora = {"lora_modules": [{"name": "x", "path": "/p"}]}
        ClusterConfig.model_validate(
            {
                "models": [
                    {"engine": {"model": "/m/b", **lora}},
                    {"engine": {"model": "/m/c", **lora}},
                ]
            }
        )


def test_the_top_level_model_is_refused_beside_models():
    with pytest.raises(ValidationError, match=r"engine.model \('/m/x'\) is per model"):
        ClusterConfig.model_validate(
            {"engine": {"model": "/m/x"}, "models": [{"engine": {"model": "/m/y"}}]}
        )


def test_model_given_twice_serves_two_models_named_by_position():
    config = parse(
        "--model",
        "/m/llama",
        "--model",
        "/m/qwen",
        "--served-model-name",
        "first",
        "--max-num-seqs",
        "4",
        "--replicas",
        "2",
    )
    a, b = config.deployments()
    assert (a.served_name(), b.served_name()) == ("first", "qwen")
    assert a.engine.model == "/m/llama" and b.engine.model == "/m/qwen"
    assert a.engine.max_num_seqs == b.engine.max_num_seqs == 4  # flags: every model
    assert a.replicas == b.replicas == 2


def test_one_model_on_the_command_line_is_the_top_level_model():
    config = parse("--model", "/m/llama", "--served-model-name", "x")
    assert not config.models and config.engine.model == "/m/llama" and config.model_name() == "x"


def test_more_served_names_than_models_is_an_error():
    with pytest.raises(ValueError, match="--served-model-name given 3 times for 2 --model"):
        parse("--model", "/a", "--model", "/b", *["--served-model-name", "n"] * 3)


def test_lora_modules_in_both_of_vllms_forms():
    plain = parse_lora_module("sql=/adapters/sql")
    assert plain == {"name": "sql", "path": "/adapters/sql", "base_model_name": None}
    given = {"name": "chat", "path": "/adapters/chat", "base_model_name": "qwen"}
    assert parse_lora_module(json.dumps(given)) == given
    for bad, message in [
        ("sql", "must be name=path"),
        ("=/p", "must be name=path"),
        ('{"name": "x"}', 'needs string fields "name" and "path"'),
        ('{"name": "x", "path": "/p", "rank": 8}', r"unknown fields \['rank'\]"),
        ("{nope", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora_module(bad)


def test_lora_modules_go_on_the_first_model_or_on_their_base_model():
    config = parse(
        "--model",
        "/m/llama",
        "--model",
        "/m/qwen",
        "--lora-modules",
        "sql=/adapters/sql",
        json.dumps({"name": "chat", "path": "/adapters/chat", "base_model_name": "qwen"}),
    )
    a, b = config.deployments()
    assert a.adapter_names() == ["sql"] and b.adapter_names() == ["chat"]
    assert b.engine.lora_modules[0].path == "/adapters/chat" and b.engine.lora_enabled
    with pytest.raises(ValueError, match=r"base_model_name 'nope' is not a served model"):
        parse("--lora-modules", json.dumps({"name": "x", "path": "/p", "base_model_name": "nope"}))
    single = parse("--model", "/m/llama", "--lora-modules", "sql=/adapters/sql", "t=/adapters/t")
    assert single.deployments()[0].adapter_names() == ["sql", "t"]


def test_an_adapter_named_as_a_model_is_refused_on_the_command_line():
    with pytest.raises(ValidationError, match="'qwen' is used twice"):
        parse("--model", "/m/llama", "--model", "/m/qwen", "--lora-modules", "qwen=/adapters/q")


def test_flags_apply_over_the_config_files_models(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "engine: {max_num_seqs: 8}\n"
        "models:\n"
        "  - engine: {model: /m/llama, max_num_seqs: 2}\n"
        "    replicas: 3\n"
        "  - engine: {model: /m/qwen}\n"
    )
    a, b = parse("--config", str(path)).deployments()
    assert (a.engine.max_num_seqs, b.engine.max_num_seqs) == (2, 8) and a.replicas == 3
    a, b = parse("--config", str(path), "--max-num-seqs", "4", "--replicas", "1").deployments()
    assert a.engine.max_num_seqs == b.engine.max_num_seqs == 4 and a.replicas == b.replicas == 1
    with pytest.raises(ValueError, match="--model and the config file's `models:`"):
        parse("--config", str(path), "--model", "/m/other")
