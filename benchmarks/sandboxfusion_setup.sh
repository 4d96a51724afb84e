#!/usr/bin/env bash
# Prepare SandboxFusion's real server (github.com/bytedance/SandboxFusion) for benchmarks/oneshot_bench.py.
#
#   benchmarks/sandboxfusion_setup.sh CHECKOUT [VENV]      (VENV defaults to /tmp/sfvenv)
#   python benchmarks/oneshot_bench.py --sandboxfusion CHECKOUT     (SANDBOXFUSION_PYTHON=VENV/bin/python)
#
# Why a script: the server's dependencies go in a venv of their own, never this project's .venv,
# and three things its Docker image provides have to be stood in for:
#   * its pyproject.toml's runtime dependencies (poetry in the image; pip here, same version bounds);
#   * a conda root: for python it runs `source <conda root>/bin/activate sandbox-runtime && which
#     python` and finds that root by walking up from its own interpreter to a `condabin` folder. An
#     empty VENV/condabin makes VENV the root; the venv's own activate script ignores the env name,
#     so programs run under VENV/bin/python (the image runs them under a conda Python 3.10 env);
#   * docs/build, which the server mounts as static files (the image builds the docs there).
# Isolation is what its image uses by default: SANDBOX_CONFIG=local, `isolation: none` (one
# `python file.py` subprocess per request in a temp dir; the container is the only wall).
set -euo pipefail

checkout=${1:?usage: $0 SANDBOXFUSION_CHECKOUT [VENV]}
venv=${2:-/tmp/sfvenv}
test -f "$checkout/sandbox/server/server.py" || { echo "$checkout is no SandboxFusion checkout" >&2; exit 1; }

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "pydantic>=2.4.0,<2.7.0" "fastapi>=0.103.1,<0.104" "uvicorn[standard]==0.25.0" \
    "structlog>=23.1,<24" "psutil>=5.9.8,<6" "aiofiles>=23.2.1,<24" "aiohttp>=3.9.5,<4" "tenacity>=8.4.2,<9" \
    "databases[aiomysql,aiosqlite]>=0.9,<0.10" "transformers>=4.44,<5" pyyaml
mkdir -p "$venv/condabin" "$checkout/docs/build"
echo "ready: python benchmarks/oneshot_bench.py --sandboxfusion $checkout (SANDBOXFUSION_PYTHON=$venv/bin/python)"
