"""``python -m sandbox``: argument parsing and refusal of unsafe settings."""

from __future__ import annotations

import pytest

from sandbox.__main__ import build_parser, main


def test_serve_arguments_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "--host", "127.0.0.1", "--port", "9000", "--workers-pool-size", "3"]
    )
    assert (args.host, args.port, args.pool_size) == ("127.0.0.1", 9000, 3)


def test_non_loopback_without_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("SANDBOX_AUTH_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "auth token" in capsys.readouterr().err


def test_no_subcommand_is_an_error() -> None:
    with pytest.raises(SystemExit):
        main([])
