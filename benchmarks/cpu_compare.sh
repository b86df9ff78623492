#!/usr/bin/env bash
# The CPU comparison of benchmarks/README.md: Sluice, llama.cpp's llama-server
# and vLLM's CPU build on the bundled SmolLM2-135M, one server at a time on the
# same host, each sent the same requests (same sluice-bench seed):
#
#   random 256 in / 128 out (ignore_eos) at concurrency 1 and 8 (32 requests)
#   and 32 (64 requests); shared-prefix 1,024 + 32 -> 64 at concurrency 8.
#
#   LLAMA_SERVER=path/to/llama-server VLLM_PYTHON=path/to/vllm-venv/bin/python \
#       bash benchmarks/cpu_compare.sh [OUT_DIR]
#
# MODEL=path/to/model.gguf serves that file instead (every server reads the
# same .gguf: llama.cpp directly, Sluice and vLLM its converted folder, which
# also gives the tokenizer); it then runs random INPUT_LEN in / OUTPUT_LEN out
# (defaults 256 / 64, ignore_eos) at each of CONCURRENCY (default 1,8,16),
# NUM_PROMPTS requests (default 16) each, and no shared-prefix run (SHARED=1
# adds it). For a 1B-class model (benchmarks/README.md, issue 35):
#
#   python benchmarks/weight_memory.py --shape llama-1b --quant Q4_K_M --write-only --out /tmp/wm
#   MODEL=/tmp/wm/llama-1b-Q4_K_M.gguf LLAMA_SERVER=.../llama-server bash benchmarks/cpu_compare.sh
#
# After its runs, each server's processes' resident memory (VmRSS, and the
# peak VmHWM) goes into NAME-memory.txt. benchmarks/build_llama_cpp.sh builds
# llama-server from PyPI's llama-cpp-python sources.
#
# A peer whose variable is unset is left out. SLUICE_ARGS adds flags to
# sluice-launcher (e.g. "--dtype bfloat16"); LABEL names that run; SKIP_SLUICE=1
# runs the peers only. VLLM_DTYPE (default bfloat16) is vLLM's --dtype, and
# VLLM_PRELOAD goes into its LD_PRELOAD (vLLM's CPU guide preloads tcmalloc
# and Intel OpenMP); VLLM_LABEL names its files (default vllm). With MODEL,
# vLLM needs VLLM_MODEL, a dense folder of the same weights
# (benchmarks/dense_folder.py writes one): the converted folder leaves the
# block-served matrices in the .gguf, which vLLM would not load.
# Run it on a quiet machine: nothing else should be using the cores.
set -euo pipefail

out=${1:-benchmarks/results/cpu-compare-$(date +%Y%m%d-%H%M)}
mkdir -p "$out"
threads=${THREADS:-$(nproc)}
gguf=${MODEL:-$(python -c 'from sluice_server.download import bundled_model_path; print(bundled_model_path())')}
folder=$(python -c 'import sys; from sluice_server.download import resolve_model; print(resolve_model(sys.argv[1]))' "$gguf")
label=${LABEL:-sluice}

wait_ready() {  # url pid
    for _ in $(seq 1 600); do
        if curl -sf "$1" >/dev/null; then return 0; fi
        kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
        sleep 1
    done
    echo "server not ready after 600 s" >&2
    return 1
}

memory() {  # name pid: VmRSS and VmHWM of pid and every process below it
    local pids=$2 todo=$2 p
    while [[ -n $todo ]]; do
        local next=""
        for p in $todo; do next="$next $(pgrep -P "$p" || true)"; done
        todo=$(echo $next)
        pids="$pids $todo"
    done
    for p in $pids; do
        [[ -r /proc/$p/status ]] || continue
        printf '%s %s: %s\n' "$p" "$(tr '\0' ' ' </proc/$p/cmdline | cut -c1-80)" \
            "$(grep -E '^(VmRSS|VmHWM)' /proc/$p/status | tr -s ' \n' ' ')"
    done >"$out/$1-memory.txt"
}

bench() {  # name port
    local name=$1 url=http://127.0.0.1:$2
    if [[ -n ${MODEL:-} ]]; then
        sluice-bench --base-url "$url" --tokenizer "$folder" --workload random --input-len "${INPUT_LEN:-256}" \
            --output-len "${OUTPUT_LEN:-64}" --num-prompts "${NUM_PROMPTS:-16}" --concurrency "${CONCURRENCY:-1,8,16}" \
            --warmup 2 --seed 7 --no-progress --out "$out/$name-random.json"
        [[ ${SHARED:-0} == 1 ]] || return 0
        sluice-bench --base-url "$url" --tokenizer "$folder" --workload shared-prefix --num-groups 1 \
            --prompts-per-group 32 --system-prompt-len 1024 --question-len 32 --output-len 64 \
            --concurrency 8 --warmup 2 --seed 7 --no-progress --out "$out/$name-shared-prefix.json"
        return
    fi
    sluice-bench --base-url "$url" --tokenizer "$folder" --workload random --input-len 256 --output-len 128 \
        --num-prompts 32 --concurrency 1,8 --warmup 2 --seed 7 --no-progress --out "$out/$name-random-1-8.json"
    sluice-bench --base-url "$url" --tokenizer "$folder" --workload random --input-len 256 --output-len 128 \
        --num-prompts 64 --concurrency 32 --warmup 2 --seed 7 --no-progress --out "$out/$name-random-32.json"
    sluice-bench --base-url "$url" --tokenizer "$folder" --workload shared-prefix --num-groups 1 \
        --prompts-per-group 32 --system-prompt-len 1024 --question-len 32 --output-len 64 \
        --concurrency 8 --warmup 2 --seed 7 --no-progress --out "$out/$name-shared-prefix.json"
}

run() {  # name port command...
    local name=$1 port=$2
    shift 2
    "$@" >"$out/$name.log" 2>&1 &
    local pid=$!
    if wait_ready "http://127.0.0.1:$port/v1/models" "$pid"; then
        bench "$name" "$port" || true
        memory "$name" "$pid"
    fi
    kill -TERM -- "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

[[ ${SKIP_SLUICE:-0} == 1 ]] || run "$label" 8090 setsid sluice-launcher --port 8090 --hostname 127.0.0.1 \
    ${MODEL:+--model-id "$MODEL"} ${SLUICE_ARGS:-}

if [[ -n ${LLAMA_SERVER:-} ]]; then
    LD_LIBRARY_PATH=$(dirname "$LLAMA_SERVER") run llama.cpp 8091 "$LLAMA_SERVER" -m "$gguf" \
        --host 127.0.0.1 --port 8091 --parallel 32 --ctx-size 49152 -t "$threads"
fi

if [[ -n ${VLLM_PYTHON:-} && -n ${MODEL:-} && -z ${VLLM_MODEL:-} ]]; then
    echo "vLLM needs VLLM_MODEL with MODEL (benchmarks/dense_folder.py writes it); left out" >&2
elif [[ -n ${VLLM_PYTHON:-} ]]; then
    # vLLM keeps one core for its front end by default; give its model every
    # core, as the others get.
    LD_PRELOAD=${VLLM_PRELOAD:-} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
        VLLM_CPU_OMP_THREADS_BIND=0-$((threads - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        run "${VLLM_LABEL:-vllm}" 8092 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "${VLLM_MODEL:-$folder}" --served-model-name smollm2 --dtype "${VLLM_DTYPE:-bfloat16}" --port 8092 --host 127.0.0.1 \
        --max-model-len 2048
fi

echo "results in $out"
