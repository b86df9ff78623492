"""Decode steps of a mixture-of-experts model against a dense model with the
same active parameters, on CPU, in-process (no gRPC), as step_bench.py times
them.

Two random-weight GGUFs are written once (in --out, default a temporary
folder), every matrix in --quant blocks as the files users download:

    moe     Qwen3-MoE (`qwen3moe`): E experts of width I per layer, top k
    dense   Qwen3 (`qwen3`), the same attention, embedding and head, and a
            dense MLP of width k x I: the parameters one token of the MoE
            model runs through, exactly

so a decode token reads the same bytes of weights in both (when its k
experts are distinct from the other tokens'), and the goal (issue 36) is an
MoE step within 1.5x of the dense one. Both are converted as the server
converts them (--dtype auto: int8 activations on the blocks), then B
requests of --prompt-len tokens are prefilled and --steps decode steps
timed, for each batch size.

    python benchmarks/moe_bench.py                                  # the default shapes
    python benchmarks/moe_bench.py --hidden 2048 --layers 24 --experts 128 --top-k 8 \\
        --expert-width 768 --batch-sizes 1,8,32 --threads 8        # Qwen3-30B-A3B's widths, half the layers

At larger batches the MoE step reads more weights than the dense one (each
token's experts differ), so its time grows faster: the table shows where.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("server", "kernels", "benchmarks")]

from sluice_server.download import resolve_model  # noqa: E402
from sluice_server.model_runner import ModelRunner  # noqa: E402
from sluice_server.servicer import Shard  # noqa: E402
from sluice_server.testing import add_bpe_vocabulary  # noqa: E402
from sluice_server.layers import moe as moe_layer  # noqa: E402
from step_bench import memory_bandwidth, run, weight_bytes  # noqa: E402


def vocabulary(size: int) -> tuple[list[str], list[str]]:
    """(`size` tokens, merges): the 256 byte symbols of byte-level BPE, pairs
    of them with the merges that make them, and an end-of-text token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    pairs = [(a, b) for a in symbols for b in symbols][: size - len(symbols) - 1]
    return symbols + [a + b for a, b in pairs] + ["<|endoftext|>"], [f"{a} {b}" for a, b in pairs]


def random_blocks(shape: tuple[int, ...], quant: str, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of `quant` for a matrix (or stack) of `shape`,
    scales small enough that activations stay finite."""
    import gguf

    qtype = gguf.GGMLQuantizationType[quant]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, (rows, shape[-1] // block, size), dtype=np.uint8)
    d = 2.0**-9 if block == 32 else 2.0**-12
    at = size - 2 if quant == "Q6_K" else 0
    raw[..., at : at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if quant in ("Q4_K", "Q5_K"):
        # w = d * sc * q - dmin * m with q unsigned: dmin = d * (mean q)
        # centres the weights (sc and m alike on average). Weights all of one
        # sign would give every token's hidden state one common direction, so
        # that every token of a step chose the same experts.
        mean_q = 7.5 if quant == "Q4_K" else 15.5
        raw[..., 2:4] = np.frombuffer(np.float16(d * mean_q).tobytes(), dtype=np.uint8)
    return raw.reshape(*shape[:-1], -1)


def write_gguf(path: Path, args, moe: bool) -> None:
    import gguf

    arch = "qwen3moe" if moe else "qwen3"
    h, d, heads, kv = args.hidden, args.head_dim, args.heads, args.kv_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(args.top_k * args.expert_width)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if moe:
        writer.add_expert_count(args.experts)
        writer.add_expert_used_count(args.top_k)
        writer.add_expert_feed_forward_length(args.expert_width)
    tokens, merges = vocabulary(args.vocab)
    add_bpe_vocabulary(writer, tokens, merges)
    rng = np.random.default_rng(0)

    def matrix(name: str, *shape: int) -> None:
        writer.add_tensor(name, random_blocks(shape, args.quant, rng), raw_dtype=gguf.GGMLQuantizationType[args.quant])

    def vector(name: str, n: int) -> None:
        writer.add_tensor(name, np.ones(n, dtype=np.float32))

    matrix("token_embd.weight", args.vocab, h)
    matrix("output.weight", args.vocab, h)
    vector("output_norm.weight", h)
    for i in range(args.layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", h)
        vector(f"{b}.ffn_norm.weight", h)
        vector(f"{b}.attn_q_norm.weight", d)
        vector(f"{b}.attn_k_norm.weight", d)
        matrix(f"{b}.attn_q.weight", heads * d, h)
        matrix(f"{b}.attn_k.weight", kv * d, h)
        matrix(f"{b}.attn_v.weight", kv * d, h)
        matrix(f"{b}.attn_output.weight", h, heads * d)
        if moe:
            # The router in float32: random blocks would route every token alike.
            writer.add_tensor(f"{b}.ffn_gate_inp.weight", rng.standard_normal((args.experts, h)).astype(np.float32))
            matrix(f"{b}.ffn_gate_exps.weight", args.experts, args.expert_width, h)
            matrix(f"{b}.ffn_up_exps.weight", args.experts, args.expert_width, h)
            matrix(f"{b}.ffn_down_exps.weight", args.experts, h, args.expert_width)
        else:
            matrix(f"{b}.ffn_gate.weight", args.top_k * args.expert_width, h)
            matrix(f"{b}.ffn_up.weight", args.top_k * args.expert_width, h)
            matrix(f"{b}.ffn_down.weight", h, args.top_k * args.expert_width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model_folder(out: Path, args, moe: bool) -> Path:
    name = (f"{'moe' if moe else 'dense'}-h{args.hidden}-l{args.layers}-e{args.experts}-k{args.top_k}"
            f"-i{args.expert_width}-{args.quant}.gguf")
    path = out / name
    if not path.exists():
        print(f"writing {path}", flush=True)
        write_gguf(path, args, moe)
    return resolve_model(str(path), cache_dir=str(out / "converted"))


class ChosenExperts:
    """Records, for each expert layer call of `batch` tokens (a decode step),
    the share of the layer's experts its tokens chose."""

    def __init__(self):
        self.batch = 0
        self.shares: list[float] = []
        self._route = moe_layer.route

    def __enter__(self):
        def route(logits, spec):
            weights, ids = self._route(logits, spec)
            if ids.shape[0] == self.batch:
                self.shares.append(ids.unique().numel() / spec.num_experts)
            return weights, ids

        moe_layer.route = route
        return self

    def __exit__(self, *exc):
        moe_layer.route = self._route

    def share(self, batch: int) -> float:
        """The mean share since the last call, and start recording `batch`."""
        shares, self.shares, self.batch = self.shares, [], batch
        return sum(shares) / len(shares) if shares else 0.0


def expert_bytes(runner: ModelRunner) -> int:
    """Bytes of every expert layer's weights (blocks on CPU)."""
    return sum(t.nbytes for m in runner.model.modules() if isinstance(m, moe_layer.FusedMoE) and m.quantized
               for t in m.quantized.tensors())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=256, help="each expert's intermediate size")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--quant", default="Q8_0", help="block type of every matrix (Q8_0, Q4_K, ...)")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--max-prefill", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the --dtype path (auto: int8 on the blocks)")
    parser.add_argument("--out", default=None, help="folder for the GGUFs and their conversions (kept)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moe-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    folders = {"dense": model_folder(out, args, moe=False), "moe": model_folder(out, args, moe=True)}
    print(f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.expert_width}, "
          f"top {args.top_k} (dense MLP width {args.top_k * args.expert_width}), {args.quant}, --dtype {args.dtype}, "
          f"{torch.get_num_threads()} threads, prompt {args.prompt_len}")
    bandwidth = memory_bandwidth()
    results: dict[str, dict[int, dict]] = {}
    params = {}
    batches = [int(x) for x in args.batch_sizes.split(",")]
    for name, folder in folders.items():
        runner = ModelRunner(folder, dtype=args.dtype, device="cpu")
        params[name] = (runner.total_parameters, runner.active_parameters)
        shard = Shard(runner, urls=[])
        gc.collect()
        gc.freeze()
        results[name] = {}
        with ChosenExperts() as chosen:
            for b in batches:
                chosen.share(b)
                results[name][b] = r = run(shard, b, args.prompt_len, args.steps, args.max_prefill)
                # The weights the step must read: its linear layers', and of
                # each expert layer the share of experts its tokens chose.
                read = weight_bytes(runner, b) + chosen.share(b) * expert_bytes(runner)
                r["floor_ms"] = read / (bandwidth * 1e9) * 1e3
        del shard, runner
        gc.unfreeze()
        gc.collect()
    for name, (total, active) in params.items():
        print(f"{name:<6} parameters: {total / 1e6:.1f} M total, {active / 1e6:.1f} M active per token")
    print(f"floor: the step's weight bytes (the MoE's chosen experts only) at the copy bandwidth, "
          f"{bandwidth:.1f} GB/s")
    header = (f"{'batch':>5} {'dense ms':>9} {'moe ms':>8} {'moe/dense':>9} {'dense floor':>11} {'moe floor':>9} "
              f"{'moe/floor':>9} {'dense tok/s':>11} {'moe tok/s':>9}")
    print(header)
    print("-" * len(header))
    for b, dense in results["dense"].items():
        moe = results["moe"][b]
        print(f"{b:>5} {dense['step_ms']:>9.1f} {moe['step_ms']:>8.1f} {moe['step_ms'] / dense['step_ms']:>9.2f} "
              f"{dense['floor_ms']:>11.1f} {moe['floor_ms']:>9.1f} {moe['step_ms'] / moe['floor_ms']:>9.2f} "
              f"{dense['tokens_per_s']:>11.1f} {moe['tokens_per_s']:>9.1f}", flush=True)
    print(f"models in {out}")


if __name__ == "__main__":
    main()
