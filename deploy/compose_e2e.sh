#!/usr/bin/env bash
# The docker compose demo, built and run for real: the insecure demo, then the TLS + SuperNode
# authentication variant behind the edge (the operator's flwr through deploy/operator_tunnel.py,
# outsiders refused, the edge on 127.0.0.1 unless SUPERLINK_PUBLIC_ADDRESS says otherwise), each a
# 2-round FedProto run on digits with 2 SuperNodes (the insecure demo's on the Message API, the
# default Flower front; the variant's on the legacy front), its results.json, the containers' logs and their
# hardening (no capabilities, no-new-privileges, read-only root, ports on 127.0.0.1) checked. Every
# image built is checked for the build CA in its layers and history, and for a Python its runtime
# user can write (deploy/image_check.py). The insecure demo then survives faults (deploy/compose_e2e.py
# faults): a SuperNode crashed mid-round comes back by itself and the run finishes; a run whose
# ServerApp's SuperExec crashed resumes (resume=true) to the rounds of the same run made without
# faults. Run as root from a checkout set up with ./setup.sh:
#
#   deploy/compose_e2e.sh
#
# What it needs it installs or starts, and what it started it stops: Debian's docker.io and
# docker-compose (v1) and debootstrap with apt-get if missing, and dockerd if none runs. Images are
# kept, so a second run reuses their layers (the app's dependency stage among them, about 6.5 GB of
# disk); images its builds replaced are removed.
# Settings (environment):
#   FLOWER_IMAGES  "protofl-local" (default): Flower's images rebuilt from a debootstrapped Debian
#                  (deploy/base.Dockerfile), for hosts that reach no image registry; "flwr": Docker Hub.
#   BUILD_CA       a CA bundle that image builds trust, e.g. /etc/ssl/certs/ca-certificates.crt where
#                  HTTPS goes through a proxy with its own CA (copied into deploy/build/ for the
#                  builds, with the canary deploy/build-ca-canary.pem, both removed afterwards).
#   TORCH_INDEX_URL  where the app image's torch comes from (default PyTorch's CPU wheels; empty: PyPI).
#   DEBIAN_MIRROR  for debootstrap (default http://deb.debian.org/debian).
#   COMPOSE_E2E_ROUND_TIMEOUT  the runs' round-timeout in seconds (default 300, for a loaded host).
set -euo pipefail
cd "$(dirname "$0")/.."
export FLOWER_IMAGES=${FLOWER_IMAGES:-protofl-local}
export FLWR_VERSION=${FLWR_VERSION:-1.42.0}
python=${PYTHON:-$PWD/.venv/bin/python}
work=$(mktemp -d)
chmod 755 "$work"  # the containers' user reads the credentials below it
project=protofl-e2e-$$
compose_files=()
dockerd_pid=
tunnel_pid=

log() { echo "[compose-e2e $(date +%H:%M:%S)] $*"; }

compose() { docker-compose --project-name "$project" "${compose_files[@]}" "$@"; }

down() {
  [ ${#compose_files[@]} -gt 0 ] || return 0
  compose logs --no-color >"$work/$1.log" 2>&1 || true
  compose down --volumes --remove-orphans >/dev/null 2>&1 || true
}

cleanup() {
  status=$?
  down last
  [ -z "$tunnel_pid" ] || kill "$tunnel_pid" 2>/dev/null || true
  if [ $status -ne 0 ]; then
    log "failed; the containers' logs:"
    tail -n 60 "$work"/*.log 2>/dev/null || true
    # what each SuperNode received and sent, whole: which message a node answered, and when
    log "the SuperNodes' messages:"
    grep -hE '^supernode-[0-9]+.*(RUN |Receiving|Sending|Ignoring|Failed|ERROR)' "$work"/*.log 2>/dev/null || true
    # last, where a log's tail shows them: each traceback a container logged, with its frames and error
    log "the tracebacks in the containers' logs:"
    grep -h -A 30 'Traceback' "$work"/*.log 2>/dev/null | head -n 200 || true
  fi
  rm -f deploy/build/compose-e2e-ca.crt deploy/build/compose-e2e-canary.crt
  # images this run's builds replaced (a rebuilt app image left about 14 GB behind); the current
  # ones stay, and their layers serve the next run
  docker image prune --force >/dev/null 2>&1 || true
  if [ -n "$dockerd_pid" ]; then
    log "stopping the dockerd this script started ($dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$dockerd_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit $status
}
trap cleanup EXIT

[ "$(id -u)" -eq 0 ] || { echo "compose_e2e.sh needs root (apt-get, dockerd)" >&2; exit 2; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
[ "$FLOWER_IMAGES" = flwr ] || command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  dockerd >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null || { cat "$work/dockerd.log"; exit 1; }
fi

if [ -n "${BUILD_CA:-}" ]; then
  cp "$BUILD_CA" deploy/build/compose-e2e-ca.crt
fi
# goes wherever a CA in deploy/build/ goes: deploy/image_check.py looks for it in the images
cp deploy/build-ca-canary.pem deploy/build/compose-e2e-canary.crt

if [ "$FLOWER_IMAGES" != flwr ]; then
  if ! docker image inspect protofl-debian:bookworm >/dev/null 2>&1; then
    log "debootstrap: a minimal Debian bookworm, imported as protofl-debian:bookworm"
    debootstrap --variant=minbase bookworm "$work/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
      >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; exit 1; }
    tar -C "$work/rootfs" -c . | docker import - protofl-debian:bookworm >/dev/null
    rm -rf "$work/rootfs"
  fi
  # always built: unchanged, every layer comes from the cache; changed, no stale base is used. Its venv
  # stage (Flower installed) is tagged as well, so that the prune at the end keeps it: pruned, the next
  # run installed Flower again, and the new base image that gave made every image above it rebuild
  log "building Flower $FLWR_VERSION's images from it ($FLOWER_IMAGES/*)"
  for target in venv ""; do
    docker build --quiet -f deploy/base.Dockerfile --build-arg DEBIAN_IMAGE=protofl-debian:bookworm \
      --build-arg FLWR_VERSION="$FLWR_VERSION" ${target:+--target "$target"} \
      -t "$FLOWER_IMAGES/flower${target:+-$target}:$FLWR_VERSION" . >/dev/null
  done
  for component in superlink supernode superexec; do
    docker tag "$FLOWER_IMAGES/flower:$FLWR_VERSION" "$FLOWER_IMAGES/$component:$FLWR_VERSION"
  done
fi

export SUPERLINK_PORT=$(cd deploy && "$python" -c "import native; print(native.free_port())")
export SUPERLINK_PUBLIC_PORT=$((SUPERLINK_PORT + 1))
unset SUPERLINK_PUBLIC_ADDRESS  # the edge where the compose file publishes it by default
export CREDENTIALS_DIR=$work/credentials
[ "$FLOWER_IMAGES" = flwr ] || export EDGE_BASE_IMAGE=protofl-debian:bookworm
tunnel_port=$((SUPERLINK_PORT + 2))
flwr_side() {  # flwr_side register|run|attack|faults <variant> [args]: deploy/compose_e2e.py
  local action=$1 variant=$2
  shift 2
  "$python" deploy/compose_e2e.py "$action" --home "$work/$variant-home" "$@"
}

log "insecure demo: build and start"
# The app's dependencies (the Dockerfile's app-python stage: torch and the rest, about 6.5 GB) are an
# intermediate stage of the app image: untagged, the prune at the end removed them and every run
# installed them again. Tagged, they stay, and the next run's build takes them from the cache (a new
# version of them moves the tag, and the prune removes the old one). The two tagged stages hold the
# build CA (/tmp/build): this host's build cache, never run or pushed; the images that run are checked.
docker build --quiet -f deploy/Dockerfile --target app-python --build-arg FLWR_VERSION="$FLWR_VERSION" \
  --build-arg FLOWER_IMAGES="$FLOWER_IMAGES" \
  --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}" \
  -t "protofl-app-python:$FLWR_VERSION" . >/dev/null
compose_files=(-f docker-compose.yml -f docker-compose.override.yml)
compose build --quiet
compose up -d
flwr_side run insecure --port "$SUPERLINK_PORT" --name insecure \
  --compose "docker-compose --project-name $project ${compose_files[*]}"
log "insecure demo: faults (a SuperNode crashed mid-round; the ServerApp's SuperExec crashed, the run resumed)"
flwr_side faults insecure --port "$SUPERLINK_PORT" \
  --compose "docker-compose --project-name $project ${compose_files[*]}"
log "insecure demo: done"
down insecure

log "TLS + SuperNode authentication behind the edge: credentials, the SuperLink and the edge, the operator's tunnel"
"$python" deploy/make_credentials.py --out "$CREDENTIALS_DIR" --supernodes 2 >/dev/null
"$python" deploy/make_credentials.py --out "$work/stranger" --supernodes 0 >/dev/null  # another CA
chown -R 49999:49999 "$CREDENTIALS_DIR"  # the images' user; the CA key is elsewhere ($CREDENTIALS_DIR-ca)
compose_files=(-f docker-compose.yml -f deploy/compose.tls.yml -f deploy/compose.auth.yml)
compose build --quiet edge
log "the images: no build CA in any layer, a Python their user cannot write"
images=(protofl-superlink protofl-supernode protofl-app protofl-edge)
[ "$FLOWER_IMAGES" = flwr ] || images+=("$FLOWER_IMAGES/flower")
"$python" deploy/image_check.py --canary deploy/build-ca-canary.pem "${images[@]/%/:$FLWR_VERSION}"
compose up -d superlink edge
"$python" deploy/operator_tunnel.py --edge "127.0.0.1:$SUPERLINK_PUBLIC_PORT" --listen "127.0.0.1:$tunnel_port" \
  --credentials "$CREDENTIALS_DIR" --server-name localhost >"$work/tunnel.log" 2>&1 &
tunnel_pid=$!
log "outsiders at the edge, key registration through the operator's tunnel, the rest"
flwr_side attack outsider --port "$SUPERLINK_PUBLIC_PORT" --root-certificates "$CREDENTIALS_DIR/ca.crt" \
  --stranger "$work/stranger" --compose "docker-compose --project-name $project ${compose_files[*]}"
flwr_side register edge --port "$tunnel_port" --keys "$CREDENTIALS_DIR"/supernode-1.pub "$CREDENTIALS_DIR"/supernode-2.pub
compose up -d
# this run takes the legacy Flower front (flower-api), the insecure demo's the Message API, the default
flwr_side run edge --port "$tunnel_port" --name edge --flower-api legacy \
  --compose "docker-compose --project-name $project ${compose_files[*]}"
down edge
log "passed"
