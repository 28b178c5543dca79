#!/usr/bin/env bash
# The GPU check: every figure issue 15 asks of an H200 and issue 46 its restore figures, in one run (~6.5 min, up to 2.5 more with the speculative step), into one file.
#
#   bench/gpu_prepare.sh            # once, on a machine with network: fills bench/gpu_deps/
#   bench/gpu_check.sh              # on the GPU machine (no network, no Redis needed)
#   bench/gpu_check.sh --cpu        # the same steps at CPU sizes (shows the script works)
#   STEPS=environment,speculative bench/gpu_check.sh   # only the steps named
#
# Writes $OUT/gpu_check.txt (OUT defaults to bench/out): environment (GPU, driver, torch,
# CUDA), CUDA parity vs transformers (fp32 and bf16, Llama GQA and GPT-2), 3-turn sessions
# restored from the host tier and from Redis vs cold, the engine bench (prefill
# 512/2048/8192, decode batch 1/8/32 vs transformers, bf16), cold turns of new and repeated
# lengths through the engine (what a new shape costs), the restore bench (cold vs device
# vs host vs Redis TTFT at 8k history, without and with --restore-stages), the restore
# figures against their limits measured in the same run (host-tier restore vs pinned H2D,
# the 8k returning turn from the host tier vs cold, Redis restore on 1 and 4 connections
# vs raw GET and 3 GB/s, int8/fp8 Redis formats decoded on the device vs exact), and
# speculative decoding from the conversation against plain decoding
# (the default model and the 1.1B shape, bf16: tok/s, tokens a step, the step's fixed and
# per-row cost, greedy tokens identical). Each step has its own time limit; a failed step is recorded and the
# rest still run. Exit status: the number of failed steps.
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

if [ "$MODE" = gpu ]; then  # sized for a 15-minute device lease (its start included): ~6.5-9 minutes
    DEV=(--device cuda)
    ENGINE=(--device cuda --dtype bfloat16 --shapes 1.1b --prompt-lens 512,2048,8192 --batches 1,8,32
            --decode-tokens 32 --repeats 2)
    SHAPES=(--device cuda --shape 1.1b --prompts 8192,8192,8000,2048,2048,2000 --decode 32)
    RESTORE=(--device cuda --dtype bfloat16 --shapes tinyllama --histories 8192 --reps 2
             --kv-formats exact --paths host,redis)
    RESTOREFIG=(--device cuda --tokens 8192 --reps 5 --models "$OUTDIR/models")  # the checkpoint restore-bench built
    FORMATS=(--device cuda --dtype bfloat16 --shapes tinyllama --histories 8192 --reps 1
             --formats exact,int8,fp8 --formats-only --sessions 8)
    SPEC=(--device cuda --dtype bfloat16 --clock wall --shapes default,1.1b --tokens 96 --repeats 3)
else
    DEV=(--device cpu)
    ENGINE=(--quick --dtype bfloat16)
    SHAPES=(--shape tiny --prompts 256,256,200,64 --decode 8)
    RESTORE=(--quick --kv-formats exact --paths host,disk,redis)
    RESTOREFIG=(--device cpu --tokens 512 --reps 2 --models "$OUTDIR/models")
    FORMATS=(--quick --formats exact,bf16,int8,fp8 --formats-only --sessions 4)
    SPEC=(--device cpu --clock wall --shapes default --tokens 32 --repeats 1)
fi

FAILED=0
step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return 0; fi
    log ""
    log "=== $name ($*)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -e "Writing model shards" -e "it/s]" | tee -a "$REPORT"
    local rc=${PIPESTATUS[0]}
    log "--- $name: $([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
}

log "kvserve GPU check ($MODE mode), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
step environment 60 python3 - <<'PY'
import platform, shutil, subprocess, torch
print("python:", platform.python_version())
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "cudnn:", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu:", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm {p.major}.{p.minor}", f"{p.multi_processor_count} SMs")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
import transformers; print("transformers:", transformers.__version__)
print("redis-server:", shutil.which("redis-server"))
PY
step parity 100 python3 bench/gpu_check.py parity "${DEV[@]}"
step sessions 120 python3 bench/gpu_check.py sessions "${DEV[@]}"
step engine-bench 150 python3 bench/bench_engine.py "${ENGINE[@]}"
step new-shapes 120 python3 bench/profile_engine.py "${SHAPES[@]}"
step restore-bench 150 python3 bench/bench_restore.py "${RESTORE[@]}" --out "$OUTDIR"
step restore 150 python3 bench/gpu_check.py restore "${RESTOREFIG[@]}"
step restore-formats 90 python3 bench/bench_restore.py "${FORMATS[@]}" --out "$OUTDIR"
step speculative 150 python3 bench/bench_speculative.py "${SPEC[@]}"
log ""
log "=== $FAILED step(s) failed; report: $REPORT"
exit "$FAILED"
