#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md's table, on one CUDA machine: the project importable with
# its train and baseline extras (DeepSpeed, TRL) and redis-server on the PATH. Each step runs
# under its own time limit and a failing step does not stop the next; JSON and a log per step
# go to $OUT (default bench/results). On a machine without a registry, bench/gpu_wheels.sh fetches
# beforehand the wheels of the baseline and gateway extras. Commands that each fit a 10-minute device call:
#
#   bash bench/gpu.sh generation learner tests    # ~4 min before the compiled learner row; allow 6
#   bash bench/gpu.sh vs_trl                      # ~5.5 min, allow 8 (VS_TRL_UPDATES=12 updates per system, see below)
#   bash bench/gpu.sh gateway                     # ~2 min (the gateway against the engine on CUDA, best of 3 rounds)
#   bash bench/gpu.sh tests learner gateway       # ~8 min: the GPU tests, the learner's MFU rows and the gateway in one call
#
# With 15 minutes of device time in all (start-up, a few minutes, included), the figures the open
# targets still lack (the learner's MFU on an H100, the gateway at 16 tokens, vs_trl in steady
# state) take two calls on one warm machine, the second right after the first:
#   LEARNER_ARGS=--no-deepspeed bash bench/gpu.sh learner:250 gateway:160    # limit 420 s
#   VS_TRL_ARGS=--no-sync bash bench/gpu.sh vs_trl:300                        # ~230 s by arithmetic
#
# A step's time limit can be set as name:seconds (learner:240); VS_TRL_ARGS go to bench/vs_trl.py
# (--no-sync leaves the sync run out: about 105 of the 333 s); LEARNER_ARGS go to bench/learner.py
# (--no-deepspeed leaves its DeepSpeed rows out; --variant NAME=KEY=VALUE adds a row under those
# config overrides), GATEWAY_ARGS to bench/gateway.py (--clients 1: one
# client process).
#
# vs_trl's speed window opens after its first 3 updates (vs_trl.py's warmup_updates: the async
# worker's lookahead + 1), so 12 updates leave 9 in it. Its time is arithmetic, not measured: from the
# 8-update H100 run of 2026-11-28 (vs_trl_gpu.json), TRL 120 s of which ~9.2 s an update, async 66 s
# at ~1.3 s an update, sync 86 s at ~4.7 s an update; 4 more updates each: TRL 120 + 37 = 157 s,
# async 66 + 5 = 71 s, sync 86 + 19 = 105 s, 333 s in all. Its limit, 480 s, leaves 147 s spare (a
# TRL run half as long again, 236 s, still fits) and fits one 10-minute device call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export RLHF_BENCH_RESULTS=$OUT RLHF_TEST_CACHE=${RLHF_TEST_CACHE:-/tmp/rlhf-bench-cache} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
VS_TRL_UPDATES=${VS_TRL_UPDATES:-12}

step() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name exit $rc $(date +%T)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for arg in "$@"; do
  what=${arg%%:*} limit=${arg#*:}
  [ "$limit" = "$arg" ] && limit=""
  case "$what" in
    generation) step generation "${limit:-200}" python3 bench/generation.py --gpu ;;
    learner) step learner "${limit:-300}" python3 bench/learner.py --gpu ${LEARNER_ARGS:-} ;;  # its compiled row compiles first
    vs_trl) step vs_trl "${limit:-480}" python3 bench/vs_trl.py --gpu --updates "$VS_TRL_UPDATES" ${VS_TRL_ARGS:-} ;;
    gateway) step gateway "${limit:-200}" python3 bench/gateway.py --gpu ${GATEWAY_ARGS:-} ;;
    # in one process: pyproject's addopts ask for pytest-xdist, which the GPU image lacks
    tests) step tests "${limit:-180}" python3 -m pytest -q -p no:cacheprovider -o addopts="--strict-markers -ra --timeout=300" tests/integration/test_hf_engine_gpu.py tests/integration/test_weight_server_gpu.py tests/integration/test_learner_gpu.py ;;
    *) echo "unknown step $what (generation, learner, vs_trl, gateway, tests)"; exit 2 ;;
  esac
done
