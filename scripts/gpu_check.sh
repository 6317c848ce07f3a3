#!/bin/bash
# Check the daemon on a GPU: two `crowdtrain run --device cuda` daemons of the demo preset train together on
# loopback until the swarm reaches an epoch, then one DMoE expert host serving every demo-moe expert on cuda
# and one trainer on cuda train until the run reaches an epoch. Logs, the last `crowdtrain status --json` and
# nvidia-smi's memory reading go to OUT (default gpu-check-results/). Needs crowdtrain and its dependencies
# importable by python3 and one CUDA device; exits 1 when a part did not reach its epoch in time or a
# daemon did not exit 0 on SIGINT. Not a test: CI has no GPU. See BENCHMARKS.md, "Checked once on a GPU".
#
#   scripts/gpu_check.sh [OUT]     env: WANT_EPOCH (5), WANT_MOE_EPOCH (2), LIMIT_S (300 per part)
set -u
OUT=$(realpath -m "${1:-gpu-check-results}")
mkdir -p "$OUT"
STATE=$(mktemp -d /tmp/crowdtrain-gpu-check-XXXXXX)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    rm -rf "$STATE"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
FAILED=0

start() {  # start NAME ARGS...: a daemon on loopback with its own state dir; its log in OUT
    local name=$1
    shift
    python3 -m crowdtrain run --state-dir "$STATE/$name" --listen /ip4/127.0.0.1/tcp/0 --device cuda "$@" \
        >"$OUT/$name.log" 2>&1 &
    PIDS+=($!)
}

address_of() {  # the first multiaddr in NAME's node.json, once it exists
    for _ in $(seq 120); do
        if [ -f "$STATE/$1/node.json" ]; then
            python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['multiaddrs'][0])" "$STATE/$1/node.json"
            return 0
        fi
        sleep 1
    done
    echo "daemon $1 did not start; see $OUT/$1.log" >&2
    return 1
}

await_epoch() {  # await_epoch PART ADDRESS EPOCH NUM_TRAINERS: until NUM_TRAINERS trainers all report EPOCH
    local part=$1 address=$2 want=$3 peers=$4 began=$SECONDS epoch=-1
    while [ $((SECONDS - began)) -lt "${LIMIT_S:-300}" ]; do
        python3 -m crowdtrain status --json --initial-peers "$address" >"$OUT/$part-status.json" 2>/dev/null
        epoch=$(python3 -c "
import json, sys
trainers = [peer for peer in json.load(open(sys.argv[1]))['peers'] if 'trainer' in peer['roles']]
print(min(peer['epoch'] for peer in trainers) if len(trainers) == int(sys.argv[2]) else -1)" \
            "$OUT/$part-status.json" "$peers" 2>/dev/null || echo -1)
        echo "$part: $((SECONDS - began)) s, epoch $epoch of $want"
        [ "$epoch" -ge "$want" ] && return 0
        sleep 5
    done
    echo "$part: epoch $want not reached in ${LIMIT_S:-300} s" >&2
    return 1
}

stop_all() {  # SIGINT every daemon started so far; each must leave with exit 0
    for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null; done
    for pid in "${PIDS[@]}"; do
        wait "$pid"
        code=$?
        [ "$code" -eq 0 ] || { echo "a daemon exited with $code" >&2; FAILED=1; }
    done
    PIDS=()
}

start dense0 --run-file demo
ADDRESS=$(address_of dense0) || exit 1
start dense1 --initial-peers "$ADDRESS"
await_epoch dense "$ADDRESS" "${WANT_EPOCH:-5}" 2 || FAILED=1
nvidia-smi --query-gpu=memory.used --format=csv,noheader >"$OUT/dense-gpu-memory.txt" 2>&1
stop_all

export CROWDTRAIN_MAX_EXPERTS=64  # one host serves the whole demo-moe grid
start moe-host --run-file demo-moe --role expert-host
unset CROWDTRAIN_MAX_EXPERTS
ADDRESS=$(address_of moe-host) || exit 1
start moe-trainer --initial-peers "$ADDRESS" --role trainer
await_epoch moe "$ADDRESS" "${WANT_MOE_EPOCH:-2}" 1 || FAILED=1
nvidia-smi --query-gpu=memory.used --format=csv,noheader >"$OUT/moe-gpu-memory.txt" 2>&1
stop_all

grep -h "epoch [0-9]*: loss" "$OUT"/*.log | tail -4
[ "$FAILED" -eq 0 ] && echo "gpu check passed; logs in $OUT" || echo "gpu check FAILED; logs in $OUT" >&2
exit "$FAILED"
