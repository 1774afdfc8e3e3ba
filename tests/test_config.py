"""Settings: precedence, validation messages, the generated default TOML."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

from framework.cli import build_parser, settings_from_args
from framework.config import Settings, SettingsError, render_default_toml

DOCS = Path(__file__).resolve().parent.parent / "docs"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return path


def test_defaults_follow_the_reference():
    s = Settings.load(None)
    assert s.scheduler.max_prefill_tokens == 16384
    assert s.scheduler.chunked_prefill_size == 8192
    assert s.scheduler.schedule_conservativeness == 1.0
    assert s.plugins.policy == "lpm"
    assert s.server.port == 30000
    assert s.server.host == "127.0.0.1"


def test_precedence_cli_over_env_over_toml(tmp_path, monkeypatch):
    path = write(tmp_path, "[server]\nport = 1111\nhost = '0.0.0.0'\n[scheduler]\nmax_prefill_tokens = 100\n")
    s = Settings.load(path)
    assert (s.server.port, s.server.host, s.scheduler.max_prefill_tokens) == (1111, "0.0.0.0", 100)

    monkeypatch.setenv("BATCHYARD_SERVER__PORT", "2222")
    s = Settings.load(path)
    assert s.server.port == 2222 and s.server.host == "0.0.0.0"

    args = build_parser().parse_args(["plugins", "--config", str(path), "--server.port", "3333"])
    s = settings_from_args(args)
    assert s.server.port == 3333
    assert s.scheduler.max_prefill_tokens == 100


def _subparsers(parser: argparse.ArgumentParser):
    """(command path, parser) for `parser` and every sub-command under it."""
    yield (), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for path, p in _subparsers(sub):
                    yield (name, *path), p


def test_every_commands_help_prints_with_every_setting():
    # argparse %-formats help strings: a setting's description with a bare % ("~40 % of") made
    # `--help` of every command with settings flags raise TypeError.
    commands = dict(_subparsers(build_parser()))
    assert ("serve",) in commands and ("bench", "offline") in commands
    with_settings = 0
    for path, parser in commands.items():
        text = parser.format_help()
        if "--server.keep-alive-timeout" in text:
            with_settings += 1
            assert "~40 % of aiohttp" in " ".join(text.split()), path
            assert "--worker.gguf-decode" in text, path
    assert with_settings >= 4


def test_settings_flags_show_a_plain_value_name():
    """`--server.port PORT`, not argparse's name from the internal dest (`SET:SERVER.PORT`)."""
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "SET:" not in text
    assert "--server.port PORT" in text and "--scheduler.enable-mixed-chunk BOOL" in text
    assert "--model.lora-paths [LORA_PATHS ...]" in text


def test_non_positive_chunk_size_disables_chunking():
    assert Settings.load(None, scheduler={"chunked_prefill_size": 0}).scheduler.chunked_prefill_size is None


@pytest.mark.parametrize(
    "toml, expected",
    [
        ("[server]\nport = -1\n", "server.port: Input should be greater than 0"),
        ("[scheduler]\nmax_prefill_tokens = 'lots'\n", "scheduler.max_prefill_tokens: Input should be a valid integer"),
        ("[model]\ndtype = 'float8'\n", "model.dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
        ("[scheduler]\nno_such_option = 1\n", "scheduler.no_such_option: Extra inputs are not permitted"),
        ("[nonsense]\nx = 1\n", "nonsense: Extra inputs are not permitted"),
        ("[model]\nint8_lm_head = true\n", "model: Value error, int8_lm_head runs the LM head on the int8 GEMMs "
         "of quantization = 'w8a8' or 'w4a8', but quantization is 'none'"),
    ],
)
def test_invalid_values_give_one_line_per_error(tmp_path, toml, expected):
    with pytest.raises(SettingsError) as info:
        Settings.load(write(tmp_path, toml))
    assert expected in str(info.value)


def test_the_int8_lm_head_comes_with_w8a8_unless_turned_off():
    """model.int8_lm_head: "auto" (the default) is on with w8a8 and off without; false keeps the
    bf16 head under w8a8; true without w8a8 is refused (above)."""
    assert Settings.load(None).model.int8_lm_head == "auto" and not Settings.load(None).model.int8_head
    w8a8 = {"quantization": "w8a8", "dtype": "bfloat16"}
    assert Settings.load(None, model=w8a8).model.int8_head
    assert Settings.load(None, model={**w8a8, "int8_lm_head": True}).model.int8_head
    assert not Settings.load(None, model={**w8a8, "int8_lm_head": False}).model.int8_head
    assert not Settings.load(None, model={**w8a8, "is_embedding": True}).model.int8_head  # (it has no use for one)
    w4a8 = {"quantization": "w4a8", "dtype": "float32"}
    assert Settings.load(None, model=w4a8).model.int8_head
    assert not Settings.load(None, model={**w4a8, "int8_lm_head": False}).model.int8_head


def test_two_errors_two_lines(tmp_path):
    with pytest.raises(SettingsError) as info:
        Settings.load(write(tmp_path, "[server]\nport = 0\n[scheduler]\nstream_interval = 0\n"))
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 2
    assert lines[0].startswith("server.port:") or lines[1].startswith("server.port:")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(SettingsError, match="config file not found"):
        Settings.load(tmp_path / "nope.toml")
    with pytest.raises(SettingsError, match="invalid TOML"):
        Settings.load(write(tmp_path, "[server\n"))
    with pytest.raises(SettingsError, match="is a directory; give a TOML file"):
        Settings.load(tmp_path)
    with pytest.raises(SettingsError, match="empty path"):  # (not "config file  is a directory")
        Settings.load("")
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("[model]\nserved_model_name = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(SettingsError, match="not UTF-8 text"):
        Settings.load(latin1)


@pytest.mark.parametrize("written", ["", "none", "NULL", " "])
def test_an_empty_setting_can_be_written_in_toml_env_and_flags(tmp_path, monkeypatch, written):
    """docs: `server.request_timeout` "empty for none": TOML, env variables and flags have no null,
    so "" (and "none"/"null" for a setting that is no text) mean empty."""
    path = write(tmp_path, f'[server]\nrequest_timeout = "{written}"\n[cache]\nmax_total_tokens = "{written}"\n')
    loaded = Settings.load(path)
    assert loaded.server.request_timeout is None and loaded.cache.max_total_tokens is None
    monkeypatch.setenv("BATCHYARD_SERVER__REQUEST_TIMEOUT", written)
    assert Settings.load(write(tmp_path, "[server]\nrequest_timeout = 5\n")).server.request_timeout is None
    monkeypatch.delenv("BATCHYARD_SERVER__REQUEST_TIMEOUT")
    args = build_parser().parse_args(["config", "--server.request-timeout", written])
    assert settings_from_args(args).server.request_timeout is None
    # A text setting keeps "none" as text; "" is empty there too.
    assert Settings.load(None, model={"served_model_name": "none"}).model.served_model_name == "none"
    assert Settings.load(None, model={"path": ""}).model.path is None


def test_an_empty_flag_empties_a_list_setting(tmp_path):
    """docs: `--flag ""` sets a setting whose default is empty back to empty; for a list setting
    it came through as [""] (a plugin named "" to disable, an adapter "" refused)."""
    path = write(tmp_path, '[plugins]\ndisable = ["clients"]\n[model]\nlora_paths = ["a=/adapters/a"]\n')
    args = build_parser().parse_args(["config", "--config", str(path), "--plugins.disable", "",
                                      "--model.lora-paths", ""])
    s = settings_from_args(args)
    assert s.plugins.disable == [] and s.model.lora_paths == []
    args = build_parser().parse_args(["config", "--plugins.disable", "clients", "faults"])
    assert settings_from_args(args).plugins.disable == ["clients", "faults"]


def test_a_misspelt_env_section_is_refused(monkeypatch):
    monkeypatch.setenv("BATCHYARD_SCHEDULAR__MAX_PREFILL_TOKENS", "1")
    with pytest.raises(SettingsError, match="BATCHYARD_SCHEDULAR__MAX_PREFILL_TOKENS: no settings section 'schedular'"):
        Settings.load(None)


@pytest.mark.parametrize("name, meant", [
    ("BATCHYARD_SERVER_PORT", "BATCHYARD_SERVER__PORT"),
    ("BATCHYARD_PORT", "BATCHYARD_SERVER__PORT"),
    ("BATCHYARD_scheduler_max_prefill_tokens", "BATCHYARD_SCHEDULER__MAX_PREFILL_TOKENS"),
])
def test_a_setting_written_with_single_underscores_is_refused(monkeypatch, name, meant):
    """pydantic-settings would ignore it, and the setting keep its default."""
    monkeypatch.setenv(name, "8000")
    with pytest.raises(SettingsError, match=f"{name}: not a setting's variable; did you mean {meant}\\?"):
        Settings.load(None)


def test_a_list_settings_env_variable_takes_json(monkeypatch):
    """pydantic-settings reads it as JSON; its message named neither the variable nor the form."""
    monkeypatch.setenv("BATCHYARD_PLUGINS__DISABLE", "clients")
    with pytest.raises(SettingsError, match=re.escape(
            "BATCHYARD_PLUGINS__DISABLE: a list setting takes JSON, e.g. BATCHYARD_PLUGINS__DISABLE='[\"a\", \"b\"]' "
            "(got 'clients')")):
        Settings.load(None)
    monkeypatch.setenv("BATCHYARD_PLUGINS__DISABLE", '["clients"]')
    assert Settings.load(None).plugins.disable == ["clients"]
    monkeypatch.setenv("BATCHYARD_PLUGINS__DISABLE", "")  # empty, as an empty variable empties other settings
    assert Settings.load(None).plugins.disable == []


def test_other_batchyard_variables_are_not_settings(monkeypatch):
    for name in ("BATCHYARD_CACHE_DIR", "BATCHYARD_KERNEL_CACHE", "BATCHYARD_INT8_GEMM", "BATCHYARD_MALLOC"):
        monkeypatch.setenv(name, "x")
    assert Settings.load(None).server.port == 30000


@pytest.mark.parametrize("section, values, message", [
    ("server", {"host": ""}, "server.host: String should have at least 1 character"),
    ("server", {"log_level": "verbose"}, "server.log_level: Input should be 'critical', 'error', 'warning', 'info', "
                                         "'debug' or 'trace'"),
    ("cache", {"eviction": "lfuu"}, "cache.eviction: Input should be 'lru', 'lfu' or 'priority'"),
])
def test_free_text_settings_are_checked_before_start_up(section, values, message):
    """An empty host bound every interface; a log level uvicorn does not know, or an unknown
    eviction order, failed with a traceback after the model had loaded."""
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings.load(None, **{section: values})


def test_a_misspelt_toml_setting_names_the_one_it_probably_meant(tmp_path):
    path = write(tmp_path, "[server]\nprot = 8000\n[scheduler]\nno_such_option = 1\n")
    with pytest.raises(SettingsError) as caught:
        Settings.load(path)
    lines = str(caught.value).splitlines()
    assert "server.prot: Extra inputs are not permitted (got 8000) (did you mean server.port?)" in lines
    assert "scheduler.no_such_option: Extra inputs are not permitted (got 1)" in lines


def test_a_setting_in_the_wrong_section_names_its_section(tmp_path):
    """A key above every section header (TOML puts it at the top level) or under another section
    is the common slip; the error names the section it belongs to (when only one has it)."""
    path = write(tmp_path, "port = 8000\n[scheduler]\nkv_cache_memory_mb = 512\nhost = 'x'\n[cache]\n"
                           "eviction = 'lru'\n")
    with pytest.raises(SettingsError) as caught:
        Settings.load(path)
    lines = str(caught.value).splitlines()
    assert "port: Extra inputs are not permitted (got 8000) (did you mean server.port?)" in lines
    assert ("scheduler.kv_cache_memory_mb: Extra inputs are not permitted (got 512) "
            "(did you mean cache.kv_cache_memory_mb?)") in lines
    assert "scheduler.host: Extra inputs are not permitted (got 'x') (did you mean server.host?)" in lines


def test_a_log_level_is_taken_in_any_case(monkeypatch):
    monkeypatch.setenv("BATCHYARD_SERVER__LOG_LEVEL", "WARNING")
    assert Settings.load(None).server.log_level == "warning"


def test_config_command_redacts_the_secrets(monkeypatch, capsys):
    monkeypatch.setenv("BATCHYARD_SERVER__API_KEY", "topsecret")
    args = build_parser().parse_args(["config"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "topsecret" not in out and json.loads(out)["server"]["api_key"] == "<redacted>"


def test_a_worker_device_of_no_known_kind_is_refused():
    with pytest.raises(SettingsError, match="worker.device: Value error, must be cpu, cuda or cuda:N"):
        Settings.load(None, worker={"device": "tpu"})
    assert Settings.load(None, worker={"device": "cuda:1"}).worker.device == "cuda:1"


def test_a_kv_pool_too_small_for_any_request_is_a_settings_error(tiny_model_folder):
    from framework.engine import Engine
    from tests.conftest import tiny_settings

    with pytest.raises(SettingsError, match="cache.max_total_tokens / model.context_length: too small"):
        Engine(tiny_settings(tiny_model_folder, cache={"max_total_tokens": 4}))


def test_every_field_has_a_description():
    from framework.config import iter_fields

    missing = [name for name, info, _ in iter_fields() if not info.description]
    assert missing == []


def test_default_toml_doc_is_current():
    assert (DOCS / "config.default.toml").read_text() == render_default_toml(), (
        "docs/config.default.toml is stale: run `batchyard config --defaults > docs/config.default.toml`"
    )


def test_default_toml_loads_to_the_defaults(tmp_path):
    loaded = Settings.load(write(tmp_path, render_default_toml()))
    assert loaded.model_dump() == Settings.load(None).model_dump()


def test_a_cuda_device_without_cuda_is_a_clear_error(tiny_model_folder):
    """worker.device = "cuda" where torch sees no GPU is refused at start-up, naming the setting
    (on a GPU, tests/test_gpu.py runs the engine there)."""
    from framework.engine import Engine
    from tests.conftest import tiny_settings

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="worker.device = 'cuda'.*sees no CUDA device"):
        Engine(tiny_settings(tiny_model_folder, worker={"device": "cuda"}))


@pytest.mark.parametrize("argv, hint", [
    (["serve", "--port", "8000"], "--port: did you mean --server.port?"),
    (["serve", "--max-running-requests=4"], "did you mean --scheduler.max-running-requests?"),
    (["generate", "hi", "--modle.dtype", "float32"], "--modle.dtype: did you mean --model.dtype?"),
    (["bench", "offline", "--cpu-kernel", "off"], "did you mean --worker.cpu-kernels?"),
    # No abbreviations: a prefix of a flag is no flag.
    (["config", "--server.por", "8000"], "--server.por: did you mean --server.port"),
    (["generate", "hi", "--max-new-token", "4"], "--max-new-token: did you mean --max-new-tokens?"),
])
def test_unknown_flag_names_the_flag_it_probably_meant(argv, hint, capsys):
    from framework.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and hint in err
    # the error and where the options are, not ~80 lines of usage above it
    assert len(err.splitlines()) == 2 and "usage:" not in err and "--help` lists the options" in err, err


def test_unknown_argument_without_a_likely_flag_is_refused_plainly(capsys):
    from framework.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--zzz-qqq", "extra"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzz-qqq extra" in err and "did you mean" not in err
