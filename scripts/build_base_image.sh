#!/usr/bin/env bash
# Build a Python base image with no container registry at all: debootstrap a minimal Debian,
# add python3 + venv + pip + the host's CA bundle, and `docker import` it. This is how CI
# builds here, and how an air-gapped cluster gets a base for sandbox/Dockerfile and
# Dockerfile.trainer (pass it as --build-arg BASE_IMAGE=...).
#
# Optionally (--wheels DIR) a second layer pre-installs every wheel in DIR into /opt/venv,
# e.g. a CPU torch wheel, so that images built on top never download a CUDA build. With
# --from IMAGE that layer goes on an existing base instead of a fresh debootstrap.
#
# Usage: scripts/build_base_image.sh [--tag NAME:TAG] [--suite bookworm] [--mirror URL]
#                                    [--wheels DIR [--from IMAGE]] [--force]
set -euo pipefail

TAG="agent-rl/base:bookworm"
SUITE="bookworm"
MIRROR=""
WHEELS=""
FROM_IMAGE=""
FORCE=0
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

while (($#)); do
  case "$1" in
    --tag) TAG="$2"; shift 2 ;;
    --suite) SUITE="$2"; shift 2 ;;
    --mirror) MIRROR="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --from) FROM_IMAGE="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { printf '[build_base_image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

if [[ -z "$FROM_IMAGE" ]]; then
  [[ $EUID -eq 0 ]] || { echo "debootstrap needs root; run with sudo" >&2; exit 1; }
  command -v debootstrap >/dev/null || { echo "install debootstrap first: apt-get install -y debootstrap" >&2; exit 1; }
fi
docker info >/dev/null 2>&1 || { echo "no reachable Docker engine (is dockerd running?)" >&2; exit 1; }
if [[ -n "$FROM_IMAGE" && -z "$WHEELS" ]]; then
  echo "--from only makes sense with --wheels" >&2; exit 2
fi
if [[ -n "$WHEELS" ]]; then
  compgen -G "$WHEELS/*.whl" >/dev/null || { echo "--wheels $WHEELS holds no *.whl files" >&2; exit 1; }
  WHEELS="$(cd "$WHEELS" && pwd)"
fi

if ((FORCE == 0)) && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "$TAG already exists (use --force to rebuild)"
  exit 0
fi

if [[ -n "$FROM_IMAGE" ]]; then
  docker image inspect "$FROM_IMAGE" >/dev/null 2>&1 || { echo "--from $FROM_IMAGE: no such image" >&2; exit 1; }
  ROOT_TAG="$FROM_IMAGE"
else
  # Without wheels the rootfs is the final image; with wheels it is an intermediate tag.
  ROOT_TAG="$TAG"
  [[ -n "$WHEELS" ]] && ROOT_TAG="${TAG%%:*}-rootfs:${TAG##*:}"

  WORK="$(mktemp -d /var/tmp/agent-rl-rootfs.XXXXXX)"
  cleanup() { rm -rf "$WORK"; }
  trap cleanup EXIT
  ROOTFS="$WORK/rootfs"

  log "debootstrap $SUITE (minbase) into $ROOTFS"
  # shellcheck disable=SC2086  # MIRROR is empty (default mirror) or one URL
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,tini \
    "$SUITE" "$ROOTFS" $MIRROR >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 30 "$WORK/debootstrap.log" >&2; exit 1; }

  # Trust the same CAs as the host, so pip inside builds works behind a TLS-intercepting proxy.
  if [[ -f "$CA_BUNDLE" ]]; then
    install -m 0644 "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
  fi
  # Trim what a container never needs: apt lists, docs, man pages, locales (keeps the image small).
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*
  find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true

  log "docker import -> $ROOT_TAG"
  tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV LANG=C.UTF-8' \
    -c 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
    -c 'CMD ["python3"]' \
    -m "agent-rl offline base: debootstrap $SUITE minbase + python3" \
    - "$ROOT_TAG" >/dev/null
fi

if [[ -n "$WHEELS" ]]; then
  # Install the wheels with a throwaway container that mounts the folder read-only and commit
  # the result: unlike COPY, the wheel files themselves never land in a layer. Their
  # dependencies come from the package index (the build container has network).
  log "pre-installing $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS into /opt/venv"
  cid="$(docker create -v "$WHEELS:/wheels:ro" "$ROOT_TAG" sh -c \
    'python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-cache-dir --find-links /wheels /wheels/*.whl')"
  docker start -a "$cid" >&2 || { docker rm -f "$cid" >/dev/null; exit 1; }
  docker commit \
    -c 'ENV VIRTUAL_ENV=/opt/venv' \
    -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["python3"]' \
    -m "pre-installed wheels: $(cd "$WHEELS" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')" \
    "$cid" "$TAG" >/dev/null
  docker rm "$cid" >/dev/null
  if [[ -z "$FROM_IMAGE" ]]; then
    docker image rm "$ROOT_TAG" >/dev/null  # only untags: the committed image still uses its layers
  fi
fi

log "built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
