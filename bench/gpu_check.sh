#!/usr/bin/env bash
# The device check: every figure of issue 46 beside its physical limit, measured in the same run, in one
# report (bench/gpu_check.py holds the steps, one function each; this runs each in its own process with
# its own time limit). Sized for a 15-minute device lease: about 6-7 minutes of steps expected (their
# limits add up to 8), 8-9 with the machine's start.
#
#   bench/gpu_prepare.sh            # once, on a machine with network: fills bench/gpu_deps/
#   bench/gpu_check.sh              # on the GPU machine (no network, no Redis needed)
#   bench/gpu_check.sh --cpu        # every step at tiny sizes on the CPU (the dry run: the script works)
#   STEPS=limits,decode,summary bench/gpu_check.sh   # only the steps named (environment always runs); their
#                                                    # figures join the last run's in $OUT (summary: all of them)
#
# Steps: limits (D2D copy, pinned H2D, bf16 matmul peak), parity (vs transformers, fp32 and bf16, decode
# through the engine's decode step), graphs (CUDA graph replay = eager, per bucket and family), sessions
# (restored = cold), decode (1.1B bf16: one stream and batch 32 vs the weight / weights+KV read limits),
# prefill (512/2048/8192 vs transformers, 8192 vs its FLOP limit), restore (host tier vs pinned H2D,
# Redis on 1 and 4 readers vs raw GET and 3 GB/s, int8/fp8 decoded on the device vs exact, the 8k
# returning turn vs cold), speculative (the chat-editing workloads vs plain decoding, greedy identical),
# summary (one table of every figure).
#
# Writes $OUT/gpu_check.txt (OUT defaults to bench/out), $OUT/figures.jsonl and $OUT/limits.json.
# A failed step is recorded and the rest still run. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUTDIR="${OUT:-bench/out}"
mkdir -p "$OUTDIR"
REPORT="$OUTDIR/gpu_check.txt"
: > "$REPORT"
DEPS=bench/gpu_deps
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

log() { echo "$*" | tee -a "$REPORT"; }

# -- offline dependencies (bench/gpu_prepare.sh) ------------------------------------
if ! python3 -c "import redis, hiredis, xxhash, sentencepiece, prometheus_client, pytest" 2>/dev/null; then
    if [ -d "$DEPS/wheels" ]; then
        python3 -m pip install --quiet --no-index --no-deps --target "$DEPS/site" \
            --find-links "$DEPS/wheels" redis hiredis xxhash sentencepiece prometheus-client \
            grpcio-health-checking grpcio-reflection pytest pluggy iniconfig packaging 2>&1 | tail -3 ||
        python3 - "$DEPS" <<'PY'  # no pip: a wheel is a zip; unpack the ones for this Python
import sys, sysconfig, zipfile, pathlib
deps = pathlib.Path(sys.argv[1]); tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
for whl in sorted((deps / "wheels").glob("*.whl")):
    if "-py3-none-any" in whl.name or f"-{tag}-" in whl.name:
        zipfile.ZipFile(whl).extractall(deps / "site")
PY
        export PYTHONPATH="$PYTHONPATH:$PWD/$DEPS/site"
    else
        log "missing Python packages and no $DEPS/wheels: run bench/gpu_prepare.sh first"
    fi
fi
if ! command -v redis-server >/dev/null && [ -x "$DEPS/redis/bin/redis-server" ]; then
    export PATH="$PWD/$DEPS/redis/bin:$PATH"
fi

if [ "$MODE" = gpu ]; then
    ARGS=(--device cuda)
    SCALE=1
else
    ARGS=(--device cpu --quick)
    SCALE=3  # the CPU's tiny sizes run slower per step than the GPU's (and share the machine)
fi
ARGS+=(--out "$OUTDIR" --work "${WORK:-${TMPDIR:-/tmp}/kvserve-gpu-check}")
[ -z "${STEPS:-}" ] && rm -f "$OUTDIR/figures.jsonl" "$OUTDIR/limits.json"  # a whole run starts afresh; pieces add to it

FAILED=0
step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$(( $2 * SCALE )); shift 2
    if [ -n "${STEPS:-}" ] && [ "$name" != environment ] && [[ ",$STEPS," != *",$name,"* ]]; then return 0; fi
    log ""
    log "=== $name ($*)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -e "Writing model shards" -e "it/s]" | tee -a "$REPORT"
    local rc=${PIPESTATUS[0]}
    log "--- $name: $([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
}

log "kvserve device check ($MODE mode), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
step environment 20 python3 - <<'PY'
import platform, shutil, subprocess, torch
print("python:", platform.python_version())
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "cudnn:", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu:", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm {p.major}.{p.minor}", f"{p.multi_processor_count} SMs")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
try:
    import triton; print("triton:", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
import transformers; print("transformers:", transformers.__version__)
print("redis-server:", shutil.which("redis-server"))
PY
# each step's limit (seconds, x3 on the CPU): what it takes on an H100/H200 with room to spare
for s in limits:20 parity:45 graphs:60 sessions:45 decode:75 prefill:45 restore:120 speculative:45 summary:10; do
    step "${s%%:*}" "${s##*:}" python3 bench/gpu_check.py "${s%%:*}" "${ARGS[@]}"
done
log ""
log "=== $FAILED step(s) failed; report: $REPORT"
exit "$FAILED"
