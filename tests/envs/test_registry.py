from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

import envs
from envs.checks import CHECKS, EnvCheckError, check_env

REPO = Path(__file__).resolve().parents[2]
BUILTIN = sorted(envs.registry.BUILTIN_ENVS)


def test_builtins_are_registered_under_the_namespace() -> None:
    assert set(BUILTIN) <= set(envs.registered_ids())
    assert all(i.startswith("agent_rl/") for i in BUILTIN)


@pytest.mark.parametrize("env_id", BUILTIN)
def test_our_check_env_passes_for_every_registered_env(env_id: str, sandbox) -> None:
    kwargs = {"sandbox": sandbox} if "Python" in env_id else {}
    env = gym.make(env_id, **kwargs)
    assert check_env(env) == list(CHECKS)
    env.close()


def test_every_registered_id_passes_our_checks(sandbox) -> None:
    # Includes plugin ids: anything registered through envs.register must pass.
    for env_id in envs.registered_ids():
        env = gym.make(env_id)
        check_env(env)
        env.close()


@pytest.mark.parametrize("env_id", BUILTIN)
def test_gymnasium_check_env_passes_without_warnings(env_id: str, sandbox) -> None:
    kwargs = {"sandbox": sandbox} if "Python" in env_id else {}
    env = gym.make(env_id, render_mode="ansi", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(env.unwrapped)
    env.close()


def test_make_round_trip_exposes_task_and_messages(sandbox) -> None:
    env = gym.make("agent_rl/PythonMath-v0", sandbox=sandbox, difficulty=0, seed=1)
    obs, _ = env.reset(seed=4, options={"task_index": 3})
    assert env.unwrapped.task == envs.GeneratedTasks(difficulty=0, seed=1)[3]
    assert env.unwrapped.messages == obs and env.spec.id == "agent_rl/PythonMath-v0"
    episode = envs.demonstration(env, 3)
    assert episode.total_reward == 1.0
    remade = env.spec.make()  # Gymnasium deep-copies kwargs here: the Shared backend must survive
    assert remade.unwrapped.tools["python"].backend is sandbox
    remade.close()
    env.close()


def test_raw_backend_object_survives_gymnasium_spec_copies(sandbox) -> None:
    raw = sandbox.backend  # a LocalSandbox: holds locks and processes, cannot be deep-copied
    env = gym.make("agent_rl/PythonArithEasy-v0", sandbox=raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env.spec is not None and env.spec.id == "agent_rl/PythonArithEasy-v0"
        remade = env.spec.make()
    assert remade.unwrapped.tools["python"].backend.backend is raw
    assert envs.demonstration(remade, 0).total_reward == 1.0
    remade.close()
    env.close()


def test_duplicate_ids_are_an_error_and_unregister_works() -> None:
    envs.register("test_ns/Dup-v0", entry_point="envs.math_envs:MathNoToolEnv")
    try:
        with pytest.raises(ValueError, match="already registered"):
            envs.register("test_ns/Dup-v0", entry_point="envs.math_envs:PythonMathEnv")
        envs.register("test_ns/Dup-v0", entry_point="envs.math_envs:MathNoToolEnv", exist_ok=True)
    finally:
        envs.unregister("test_ns/Dup-v0")
    assert "test_ns/Dup-v0" not in gym.registry and "test_ns/Dup-v0" not in envs.registered_ids()


def test_checker_names_the_failing_check() -> None:
    class NoEnd(envs.ToolEnv):
        def step(self, action):
            obs, r, _, _, info = super().step(action)
            return obs, r, False, False, info

    with pytest.raises(EnvCheckError, match=r"\[plain_text_ends_episode\]"):
        check_env(NoEnd([envs.Task("q", "1")], tools=[]))


def _write_plugin(root: Path, dist: str, module: str, body: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[agent_rl.envs]\n{dist} = {module}:register_all\n")


def _import_envs_in_subprocess(path: Path) -> subprocess.CompletedProcess:
    code = "import envs, gymnasium; print(sorted(i for i in gymnasium.registry if i.startswith('plug')))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(REPO)])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_pip_installed_plugin_registers_on_import_and_broken_one_only_warns(tmp_path: Path) -> None:
    _write_plugin(
        tmp_path,
        "good_plugin",
        "good_plugin_mod",
        """
        import envs

        def register_all():
            envs.register("plug/Good-v0", entry_point="envs.math_envs:MathNoToolEnv")
        """,
    )
    _write_plugin(
        tmp_path,
        "bad_plugin",
        "bad_plugin_mod",
        """
        def register_all():
            raise RuntimeError("missing model file")
        """,
    )
    proc = _import_envs_in_subprocess(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['plug/Good-v0']"
    assert (
        "PluginWarning" in proc.stderr
        and "'bad_plugin'" in proc.stderr
        and "missing model file" in proc.stderr
    )


def test_load_plugins_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_plugin(
        tmp_path,
        "inproc_plugin",
        "inproc_plugin_mod",
        """
        import envs

        def register_all():
            envs.register("plug/InProc-v0", entry_point="envs.math_envs:MathNoToolEnv")
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "inproc_plugin" in envs.load_plugins()
        assert "plug/InProc-v0" in envs.registered_ids()
        assert envs.load_plugins() == []  # each plugin loads once
    finally:
        envs.unregister("plug/InProc-v0")


def test_make_with_module_prefix_imports_envs_lazily() -> None:
    code = (
        "import gymnasium as gym; env = gym.make('envs:agent_rl/MathNoTool-v0');"
        "print(env.reset(seed=0)[0][1]['role'])"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "user"
