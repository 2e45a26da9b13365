#!/usr/bin/env bash
# N replicas of one bundle on this machine behind SMG (the Shepherd Model Gateway, `pip install .[cluster]`), all
# on 127.0.0.1: each replica gets its share of the cores (--threads), SMG routes with --policy (default
# cache_aware). Prints each replica's URL and then `gateway: http://127.0.0.1:PORT/v1`; runs until CTRL-C /
# SIGTERM / SMG exiting, then stops everything it started (replicas drain, bounded). docs/cluster.md. (Started in
# the background by a non-interactive shell, bash ignores SIGINT, as it does for every such job: stop it with SIGTERM.)
# Usage: scripts/cluster.sh BUNDLE [--replicas N] [--policy POLICY] [--port PORT] [-- omforge serve args…]
# Env: SMG (the smg command; default .venv/bin/smg, else smg on PATH), SMG_ARGS (extra `smg launch` flags),
# CLUSTER_LOG_DIR (where the logs go; default a fresh temporary directory, kept).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
usage() { echo "usage: scripts/cluster.sh BUNDLE [--replicas N] [--policy POLICY] [--port PORT] [-- serve args…]" >&2
          exit 2; }
[ $# -ge 1 ] || usage
BUNDLE=$1; shift
REPLICAS=2 POLICY=cache_aware PORT=
while [ $# -gt 0 ]; do
  case $1 in
    --replicas) REPLICAS=${2:?}; shift 2 ;;
    --policy) POLICY=${2:?}; shift 2 ;;
    --port) PORT=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[[ $REPLICAS =~ ^[1-9][0-9]*$ ]] || { echo "cluster.sh: error: --replicas: expected a positive integer" >&2; exit 2; }
[ -f "$BUNDLE/manifest.json" ] || { echo "cluster.sh: error: $BUNDLE: no manifest.json (not a bundle)" >&2; exit 2; }
OMFORGE=$HERE/.venv/bin/omforge; [ -x "$OMFORGE" ] || OMFORGE=omforge
SMG=${SMG:-$HERE/.venv/bin/smg}; [ -x "$SMG" ] || SMG=$(command -v smg || true)
[ -n "$SMG" ] || { echo "cluster.sh: error: smg not found: pip install '.[cluster]'" >&2; exit 2; }
PY=$HERE/.venv/bin/python; [ -x "$PY" ] || PY=python3
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=${PORT:-$(free_port)}
THREADS=$(( $(nproc) / REPLICAS )); [ "$THREADS" -ge 1 ] || THREADS=1
LOGS=${CLUSTER_LOG_DIR:-$(mktemp -d /tmp/omforge-cluster.XXXXXX)}
mkdir -p "$LOGS"

PIDS=()
stop() {  # SIGTERM to all (replicas drain), then at most 40 s before SIGKILL
  trap - EXIT INT TERM
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 80); do
    alive=0; for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  echo "cluster: stopped (logs in $LOGS)"
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

URLS=()
for i in $(seq 1 "$REPLICAS"); do
  "$OMFORGE" serve "$BUNDLE" --host 127.0.0.1 --port 0 --threads "$THREADS" "$@" >"$LOGS/replica$i.log" 2>&1 &
  PIDS+=($!)
done
for i in $(seq 1 "$REPLICAS"); do  # bounded: at most 180 s for a replica to load the bundle
  url=
  for _ in $(seq 1 360); do
    url=$(grep -o 'listening on http://[^ ]*/v1' "$LOGS/replica$i.log" | sed 's,^listening on ,,; s,/v1$,,' || true)
    [ -n "$url" ] && break
    kill -0 "${PIDS[$((i - 1))]}" 2>/dev/null || { cat "$LOGS/replica$i.log" >&2; exit 1; }
    sleep 0.5
  done
  [ -n "$url" ] || { echo "cluster.sh: error: replica $i did not start within 180 s ($LOGS/replica$i.log)" >&2; exit 1; }
  URLS+=("$url")
  echo "replica $i: $url (threads $THREADS, log $LOGS/replica$i.log)"
done

# SMG probes each worker (/v1/models, /version: omforge answers as vLLM-compatible) and health-checks /health.
# shellcheck disable=SC2086
"$SMG" launch --host 127.0.0.1 --port "$PORT" --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
  --worker-urls "${URLS[@]}" --policy "$POLICY" --worker-startup-check-interval 1 --log-level warn \
  ${SMG_ARGS:-} >"$LOGS/smg.log" 2>&1 &
SMG_PID=$!
PIDS+=("$SMG_PID")
ready=0
for _ in $(seq 1 120); do  # bounded: at most 60 s until every replica is registered with the gateway
  n=$("$PY" - "http://127.0.0.1:$PORT" <<'PY' 2>/dev/null || true
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/workers", timeout=2) as r:
    workers = json.load(r).get("workers", [])
print(sum(bool(w.get("is_healthy", True)) for w in workers))
PY
)
  [ "${n:-0}" -ge "$REPLICAS" ] && { ready=1; break; }
  kill -0 "$SMG_PID" 2>/dev/null || { cat "$LOGS/smg.log" >&2; exit 1; }
  sleep 0.5
done
[ $ready = 1 ] || { echo "cluster.sh: error: SMG did not register $REPLICAS workers within 60 s ($LOGS/smg.log)" >&2
                    exit 1; }
echo "gateway: http://127.0.0.1:$PORT/v1 (SMG, policy $POLICY, log $LOGS/smg.log)"
wait "$SMG_PID" || true  # SMG exiting (or a signal) ends the cluster; the EXIT trap stops the replicas
