"""`pegainfer serve`'s configuration: the server section, its validation, the API key's fallback."""

from __future__ import annotations

import pytest

from pegainfer.cli import main
from pegainfer.config.compose import build_engine_config, build_server_config, compose
from pegainfer.errors import ConfigError
from pegainfer.server.config import API_KEY_ENV, ServerConfig


def test_defaults_serve_the_demo_on_loopback() -> None:
    cfg = compose("serve")
    assert build_server_config(cfg) == ServerConfig()
    assert ServerConfig().host == "127.0.0.1" and ServerConfig().port == 8000
    assert build_engine_config(cfg).model.path is None  # the embedded demo model


def test_overrides_and_errors_name_the_key() -> None:
    server = build_server_config(
        compose("serve", ["server.port=9001", "server.api_key=abc", "model=qwen3_14b"])
    )
    assert server.port == 9001 and server.resolved_api_key() == "abc"
    with pytest.raises(ConfigError, match="invalid value for 'server.port'"):
        build_server_config(compose("serve", ["server.port=70000"]))
    with pytest.raises(ConfigError, match="did you mean 'server.port'"):
        compose("serve", ["server.prot=1"])


def test_api_key_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert ServerConfig().resolved_api_key() is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerConfig().resolved_api_key() == "from-env"
    assert ServerConfig(api_key="from-config").resolved_api_key() == "from-config"


def test_cli_serve_cfg_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--cfg", "job", "model=qwen3_14b", "server.port=9002"]) == 0
    out = capsys.readouterr().out
    assert "port: 9002" in out and "name: qwen3_14b" in out and "drain_timeout" in out
    assert main(["serve", "server.nope=1"]) == 2
    assert main(["serve", "-m", "server.port=1,2"]) == 2
