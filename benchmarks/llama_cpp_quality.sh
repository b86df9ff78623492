#!/usr/bin/env bash
# llama.cpp's figures beside benchmarks/quality.py's: how far llama.cpp's
# arithmetic on a quantized GGUF is from float32 of the same weights, on the
# same text (benchmarks/quality_text.txt), under teacher forcing.
#
#   LLAMA_CPP=DIR/bin bash benchmarks/llama_cpp_quality.sh MODEL.gguf [OUT]
#
# LLAMA_CPP holds llama-quantize and llama-perplexity (bash
# benchmarks/build_llama_cpp.sh DIR builds them; default
# ~/.cache/sluice/llama.cpp/bin). OUT (default ./llama_cpp_quality) receives
# the float32 GGUF, the saved float32 log-probabilities and both logs.
#
# 1. llama-quantize --allow-requantize MODEL.gguf F32: the same weights,
#    dequantized to F32 (the reference quality.py's float32 row also scores).
# 2. llama-perplexity on it, float32 KV cache, saving its log-probabilities
#    (--kl-divergence-base).
# 3. llama-perplexity --kl-divergence on MODEL.gguf as llama.cpp runs it by
#    default (activations quantized to Q8_K/Q8_0/Q8_1 in the dot products,
#    f16 KV cache): perplexity of both, KL divergence, and "Same top p", the
#    share of positions where the two agree on the most likely token
#    (quality.py's "top-1 vs fp32").
#
# llama-perplexity splits the text into chunks of CTX tokens (-c; each chunk
# starting with BOS) and scores only the second half of each chunk, positions
# CTX/2 .. CTX-2. It needs at least 2*CTX tokens. The default, CTX=256, takes
# two chunks, the first 512 tokens of the text: the same tokens quality.py
# scores by default (--tokens 512), but 254 scored positions, each with 128 to
# 254 tokens of context, against quality.py's 511 with 1 to 511.
# `python benchmarks/quality.py --model MODEL.gguf --llama-cpp-ctx CTX` scores
# Sluice's paths on exactly these positions.
#
# Environment: CTX (256), THREADS (2), TEXT (benchmarks/quality_text.txt),
# BASE_KV (float32 pass's KV cache type, f32), QUANT_KV (quantized pass's, f16,
# llama.cpp's default).
set -euo pipefail

model=${1:?usage: LLAMA_CPP=DIR/bin bash benchmarks/llama_cpp_quality.sh MODEL.gguf [OUT]}
out=${2:-llama_cpp_quality}
bin=${LLAMA_CPP:-$HOME/.cache/sluice/llama.cpp/bin}
ctx=${CTX:-256}
threads=${THREADS:-2}
text=${TEXT:-$(dirname "$0")/quality_text.txt}
base_kv=${BASE_KV:-f32}
quant_kv=${QUANT_KV:-f16}

mkdir -p "$out"
name=$(basename "$model" .gguf)
f32=$out/$name-f32.gguf
base=$out/$name-f32-c$ctx.kld

if [[ ! -s $f32 ]]; then
    "$bin/llama-quantize" --allow-requantize "$model" "$f32" F32 "$threads" > "$out/quantize-f32.log" 2>&1 ||
        { tail -20 "$out/quantize-f32.log"; exit 1; }
fi
"$bin/llama-perplexity" -m "$f32" -f "$text" -c "$ctx" -b "$ctx" -t "$threads" -ctk "$base_kv" -ctv "$base_kv" \
    --kl-divergence-base "$base" > "$out/perplexity-f32-c$ctx.log" 2>&1 ||
    { tail -20 "$out/perplexity-f32-c$ctx.log"; exit 1; }
log=$out/kl-divergence-$name-c$ctx.log
"$bin/llama-perplexity" -m "$model" -f "$text" -c "$ctx" -b "$ctx" -t "$threads" -ctk "$quant_kv" -ctv "$quant_kv" \
    --kl-divergence-base "$base" --kl-divergence > "$log" 2>&1 || { tail -20 "$log"; exit 1; }

# The figures, from the summary at the end of the --kl-divergence log.
value() { grep -m1 "^$1" "$log" | sed -e 's/^[^:]*: *//'; }
chunks=$(grep -m1 -o 'computing over [0-9]* chunks' "$log" | grep -o '[0-9]*')
ppl_q=$(value 'Mean PPL(Q) ')
ppl_base=$(value 'Mean PPL(base)')
ratio=$(value 'Mean PPL(Q)/PPL(base)')
echo "model $name, llama.cpp (llama-perplexity), $text: -c $ctx, $chunks chunks," \
    "$((chunks * (ctx - 1 - ctx / 2))) scored positions; KV cache $base_kv (float32 pass), $quant_kv (quantized)"
echo "top-1 agreement (Same top p): $(value 'Same top p')"
echo "perplexity, float32 (F32 GGUF): $ppl_base"
echo "perplexity, $name:  $ppl_q"
awk -v r="${ratio%% *}" -v u="${ratio##* }" \
    'BEGIN { printf "perplexity change: %+.2f%% +/- %.2f%% (Mean PPL(Q)/PPL(base) - 1)\n", 100 * (r - 1), 100 * u }'
echo "KL divergence: mean $(value 'Mean    KLD'), median $(value 'Median  KLD'), max $(value 'Maximum KLD')"
echo "logs: $out/perplexity-f32-c$ctx.log, $log"
