from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.config import Config, ConfigError, build_config, dump_config, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    import yaml

    if "cells" in yaml.safe_load(path.read_text()):  # an experiment grid around a train config
        from agent_rl.experiment import load_experiment

        assert load_experiment(path).cells
    else:
        assert isinstance(load_config(path), Config)


def test_overrides_are_typed_and_nested() -> None:
    cfg = build_config(
        {}, ["train.lr=1e-4", "rollout.group_size=8", "env.kwargs.difficulty=2", "model.path=null"]
    )
    assert cfg.train.lr == pytest.approx(1e-4)  # parsed from "1e-4": the same double (approx: ample)
    assert cfg.rollout.group_size == 8
    assert cfg.env.kwargs == {"difficulty": 2}
    assert cfg.model.path is None


def test_override_wins_over_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 3\n")
    assert load_config(f).train.steps == 3
    assert load_config(f, ["train.steps=5"]).train.steps == 5


def test_bad_value_names_key_value_and_expectation(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    msg = str(err.value)
    assert "train.lr" in msg and "'fast'" in msg and "number" in msg


def test_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.gropu_size: unknown key"):
        build_config({"rollout": {"gropu_size": 4}})


def test_range_and_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.group_size: got 0"):
        build_config({}, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match=r"sandbox\.url"):
        build_config({}, ["sandbox.backend=http"])


@pytest.mark.parametrize("text", ["noequals", "=3"])
def test_malformed_override(text: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        build_config({}, [text])


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_dump_round_trip(tmp_path: Path) -> None:
    cfg = build_config({}, ["train.steps=7", "algo.estimator=grpo"])
    dump_config(cfg, tmp_path / "out.yaml")
    assert load_config(tmp_path / "out.yaml") == cfg
