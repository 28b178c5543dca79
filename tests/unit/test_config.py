"""ServerConfig: one table of settings read from flags, KVSERVE_* variables and defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.service.config import ConfigError, ServerConfig, env_name, flag_name, parse_bytes, parse_duration

REPO = Path(__file__).resolve().parents[2]


def test_defaults():
    cfg = ServerConfig.from_args([], {})
    assert cfg == ServerConfig()
    assert cfg.port == 50051 and cfg.kv_cache_memory == 1 << 30 and cfg.metrics_port == 0
    assert cfg.max_model_len is None and cfg.model is None


def test_flag_beats_environment_beats_default():
    env = {"KVSERVE_PORT": "6000", "KVSERVE_BLOCK_SIZE": "32", "KVSERVE_KV_CACHE_MEMORY": "512MiB", "OTHER": "x"}
    cfg = ServerConfig.from_args(["--port", "7000", "--drain-timeout", "500ms"], env)
    assert cfg.port == 7000  # flag
    assert cfg.block_size == 32  # environment
    assert cfg.kv_cache_memory == 512 << 20
    assert cfg.drain_timeout == 0.5
    assert cfg.max_num_seqs == ServerConfig().max_num_seqs  # default


def test_every_setting_has_a_flag_an_env_variable_and_help():
    parser = ServerConfig.argument_parser()
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
    for f in dataclasses.fields(ServerConfig):
        assert flag_name(f.name) in flags
        assert env_name(f.name) == "KVSERVE_" + f.name.upper()
        assert f.metadata["help"].endswith(".")
        # each setting can be set from its variable to a non-default value
        raw = {int: "300", float: "0.5" if f.name.endswith("_fraction") else "2.5", str: None}.get(type(f.default))
        if raw is not None:
            cfg = ServerConfig.from_args([], {env_name(f.name): raw})
            assert getattr(cfg, f.name) == f.metadata["parse"](raw)


@pytest.mark.parametrize(
    "text,expected",
    [("1073741824", 1 << 30), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("2gib", 2 << 30), ("1.5GB", 1_500_000_000),
     ("64 KiB", 64 << 10), ("100", 100)],
)  # fmt: skip
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12XB", "-1GiB", "1..2MiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes(text)


def test_parse_duration():
    assert parse_duration("30") == 30.0 and parse_duration("30s") == 30.0
    assert parse_duration("250ms") == 0.25 and parse_duration("2m") == 120.0
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="KVSERVE_KV_CACHE_MEMORY='lots': not a byte size"):
        ServerConfig.from_args([], {"KVSERVE_KV_CACHE_MEMORY": "lots"})
    with pytest.raises(ConfigError, match="KVSERVE_DEVICE='tpu': 'tpu' is not one of auto, cpu, cuda"):
        ServerConfig.from_args([], {"KVSERVE_DEVICE": "tpu"})


def test_out_of_range_values_name_flag_and_variable():
    with pytest.raises(ConfigError, match="--port / KVSERVE_PORT must be in 0..65535, got 70000"):
        ServerConfig.from_args(["--port", "70000"], {})
    with pytest.raises(ConfigError, match="--kv-cache-memory / KVSERVE_KV_CACHE_MEMORY must be > 0, got 0"):
        ServerConfig.from_args([], {"KVSERVE_KV_CACHE_MEMORY": "0"})


def test_bad_flag_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        ServerConfig.from_args(["--kv-cache-memory", "lots"], {})
    assert e.value.code == 2
    assert "not a byte size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ServerConfig.from_args(["--no-such-flag"], {})


def test_engine_config_carries_the_engine_settings():
    cfg = ServerConfig.from_args(
        ["--model", "/m", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--block-size", "8",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
         "--max-new-tokens-limit", "100", "--max-queue", "9"],
        {},
    )  # fmt: skip
    e = cfg.engine_config()
    assert (e.model_path, e.device, e.dtype, e.kv_cache_memory, e.block_size) == ("/m", "cpu", "float32", 64 << 20, 8)
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len) == (4, 256, 1024)
    assert (e.max_new_tokens_limit, e.max_queue) == (100, 9)


def test_docs_configuration_table_is_current():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert ServerConfig.markdown_table() in doc, "regenerate with: kvserve config --markdown"


def test_cli_help_and_config_commands():
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "KVSERVE_PORT": "1234"}
    out = subprocess.run([sys.executable, "-m", "kvserve.service", "--help"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "--kv-cache-memory" in out.stdout and "KVSERVE_KV_CACHE_MEMORY" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvserve.service.cli", "--help"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "serve" in out.stdout and "config" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvserve.service.cli", "config", "--block-size", "64"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0
    settings = {k.strip(): v for k, v in (line.split(" = ", 1) for line in out.stdout.splitlines())}
    assert settings["port"] == "1234" and settings["block_size"] == "64" and settings["kv_cache_memory"] == "1GiB"


def test_boolean_settings_are_switches_and_keep_the_environment_form():
    assert ServerConfig.from_args(["--redis-cluster"], {}).redis_cluster is True
    assert ServerConfig.from_args(["--no-redis-cluster"], {"KVSERVE_REDIS_CLUSTER": "true"}).redis_cluster is False
    assert ServerConfig.from_args([], {"KVSERVE_REDIS_CLUSTER": "yes"}).redis_cluster is True
    assert ServerConfig.from_args([], {"KVSERVE_REDIS_REQUIRED": "0"}).redis_required is False
    with pytest.raises(SystemExit):  # a switch takes no value
        ServerConfig.from_args(["--redis-cluster", "true"], {})
    assert "`--redis-cluster` / `--no-redis-cluster`" in ServerConfig.markdown_table()


def test_storage_format_names_are_the_codecs() -> None:
    from kvserve.cachestore.codec import STORAGE_FORMATS
    from kvserve.service.config import STORAGE_FORMAT_NAMES

    assert STORAGE_FORMAT_NAMES == tuple(STORAGE_FORMATS)


@pytest.mark.parametrize("fmt", ["w8a8", "q8_0", "q6_k", "q4_k_m", "q4_1", "q4_0"])
def test_a_cpu_only_weight_format_with_cuda_is_refused_before_anything_loads(fmt):
    from kvserve.service.server import StartupError, check_device

    cfg = ServerConfig.from_args(["--weight-format", fmt, "--device", "cuda"], {})
    assert cfg.weight_format == fmt
    with pytest.raises(StartupError, match=f"--weight-format {fmt} .* runs on the CPU only"):
        check_device(cfg)
    check_device(ServerConfig.from_args(["--weight-format", fmt], {}))  # the CPU: fine
