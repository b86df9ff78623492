#!/usr/bin/env bash
# The kernels' GPU check in one command: every kernel test compiled on the GPU
# (the `gpu`-marked larger set included), then the benchmark. Needs a CUDA
# machine with torch, triton and pytest; results go to ${OUT:-.}.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}"
export PYTHONPATH="$PWD/kernels:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest kernels/tests -q -p no:cacheprovider --continue-on-collection-errors --tb=short -rfE --durations=5 \
    >"$out/kernel_tests.txt" 2>&1
echo "pytest rc=$?"
tail -n 40 "$out/kernel_tests.txt"
[ "${SKIP_BENCH:-0}" = 1 ] || timeout "${BENCH_TIMEOUT:-200}" python3 kernels/benchmarks/kernel_bench.py --out "$out/bench.json" 2>&1 | tee "$out/bench.txt"
