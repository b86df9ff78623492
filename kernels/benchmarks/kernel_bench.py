"""Times each Triton kernel against a torch baseline on one GPU (not a test).

    python kernels/benchmarks/kernel_bench.py [--out results.json] [--dtype bfloat16]

Decode attention also reports its achieved memory bandwidth (the K/V bytes it
must read, over its time) as a fraction of the device's copy bandwidth,
measured in the same run by copying a large tensor. Shapes are Llama-3-8B's
attention (32 query heads, 8 KV heads, head_dim 128) and MLP (4096 / 14336).
Baselines: the shard's torch attention backend (gather the pages, then SDPA;
the one place this imports the server package) and the kernels' plain-torch
references; "speedup" is baseline time / Triton time.
For uniform batches, "dense SDPA" also times torch's fused SDPA on K/V that is
already contiguous (no paging, no gather): the bar a paged kernel aims at.
Finishes in a few minutes; exits with a message when no CUDA device exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HQ, HKV, D, BLOCK = 32, 8, 128, 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy that measures bandwidth")
    p.add_argument("--sweep", action="store_true",
                   help="also try attention launch settings (tile sizes, warps, stages, splits) and print the best")
    return p.parse_args(argv)


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def copy_bandwidth(gib: float) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (ms * 1e-3)


def paged_batch(seqs, dtype):
    """(cached, new) per sequence, decodes first -> metadata on the GPU, shuffled blocks."""
    from sluice_server.layers.attention import AttentionMetadata

    q_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int64)
    first = 0
    slots = []
    for i, (nb, (cached, new)) in enumerate(zip(blocks, seqs)):
        tables[i, :nb] = perm[first : first + nb]
        first += nb
        pos = torch.arange(cached, cached + new)
        slots.append(tables[i, pos // BLOCK] * BLOCK + pos % BLOCK)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).cuda(), query_start_loc=qsl.cuda(), seq_lens=torch.tensor(seq_lens).cuda(),
        block_tables=tables.cuda(), num_decodes=sum(1 for n in q_lens if n == 1), block_size=BLOCK,
        query_lens_list=q_lens, seq_lens_list=seq_lens,
    )
    t = sum(q_lens)
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(t, HQ, D, dtype=dtype, device="cuda")
    k = torch.randn(t, HKV, D, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    return meta, q, k, v, k_cache, v_cache


def bench_attention(name, seqs, dtype, copy_bw, rows):
    from sluice_kernels.triton.paged_attention import paged_attention, plan_attention
    from sluice_server.layers.torch_attention import TorchAttention
    from sluice_server.layers.triton_attention import TritonAttention

    meta, q, k, v, k_cache, v_cache = paged_batch(seqs, dtype)
    torch_backend = TorchAttention()
    torch_backend.prepare(meta)
    base_ms = bench_ms(lambda: torch_backend.forward(q, k, v, k_cache, v_cache, meta))
    expected = torch_backend.forward(q, k, v, k_cache, v_cache, meta)
    triton_backend = TritonAttention()
    meta.backend_state = {}
    triton_backend.prepare(meta)
    got = triton_backend.forward(q, k, v, k_cache, v_cache, meta)
    err = (got.float() - expected.float()).abs().max().item()
    plan = triton_backend._plan(meta, HQ, HKV, q.device)
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    ms = bench_ms(lambda: paged_attention(*args, plan))
    splits = [launch.num_splits for launch in plan.launches]
    row = dict(kernel="attention", case=name, triton_ms=ms, torch_ms=base_ms, speedup=base_ms / ms,
               max_abs_err=err, num_splits=splits)
    row["sdpa_dense_ms"] = sdpa_dense_ms(meta, q, k_cache, v_cache)
    if meta.num_decodes == len(seqs):
        kv_bytes = 2 * sum(meta.seq_lens_list) * HKV * D * k_cache.element_size()
        io_bytes = kv_bytes + 2 * q.numel() * q.element_size()
        row["gb_per_s"] = io_bytes / (ms * 1e-3) / 1e9
        row["frac_of_copy_bw"] = io_bytes / (ms * 1e-3) / copy_bw
        if splits != [1]:
            flat = plan_attention(meta.query_lens_list, meta.seq_lens_list, meta.num_decodes, HQ, HKV, q.device, 1)
            row["no_split_ms"] = bench_ms(lambda: paged_attention(*args, flat))
    else:
        flops = 0
        for q_len, s_len in zip(meta.query_lens_list, meta.seq_lens_list):
            visible = q_len * (s_len - q_len) + q_len * (q_len + 1) // 2
            flops += 4 * visible * HQ * D
        row["tflop_per_s"] = flops / (ms * 1e-3) / 1e12
    rows.append(row)


def sdpa_dense_ms(meta, q, k_cache, v_cache) -> float | None:
    """SDPA (flash/efficient kernels) on contiguous, un-paged K/V that is
    already gathered: a lower bound for a paged torch path. Uniform batches only."""
    import torch.nn.functional as F

    if len(set(meta.query_lens_list)) != 1 or len(set(meta.seq_lens_list)) != 1:
        return None
    b, q_len, s_len = len(meta.query_lens_list), meta.query_lens_list[0], meta.seq_lens_list[0]
    queries = q.view(b, q_len, HQ, D).transpose(1, 2).contiguous()
    keys = torch.randn(b, HKV, s_len, D, dtype=q.dtype, device=q.device)
    values = torch.randn_like(keys)
    if q_len == 1:
        return bench_ms(lambda: F.scaled_dot_product_attention(queries, keys, values, enable_gqa=True))
    if q_len == s_len:
        return bench_ms(lambda: F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True))
    return None


def sweep_attention(dtype, rows):
    """Launch settings per case, best first; a guide for DECODE_CONFIG/PREFILL_CONFIG."""
    from sluice_kernels.triton.paged_attention import paged_attention, plan_attention

    cases = [
        ("decode b=1 ctx=32768", [(32767, 1)], "decode"),
        ("decode b=8 ctx=8192", [(8191, 1)] * 8, "decode"),
        ("decode b=64 ctx=2048", [(2047, 1)] * 64, "decode"),
        ("prefill 4 x 2048 fresh", [(0, 2048)] * 4, "prefill"),
    ]
    for name, seqs, kind in cases:
        meta, q, _, _, k_cache, v_cache = paged_batch(seqs, dtype)
        args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)
        results = []
        for block_n in (32, 64, 128) if kind == "decode" else (64, 128):
            for warps in (2, 4) if kind == "decode" else (4, 8):
                for stages in (2, 3):
                    cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                    variants = [dict(decode_config=cfg)] if kind == "decode" else [
                        dict(prefill_config=cfg, prefill_block_m=m) for m in (64, 128)]
                    if kind == "decode" and len(seqs) == 1:
                        variants = [dict(decode_config=cfg, num_splits=n) for n in (32, 64)]
                    for v in variants:
                        try:
                            plan = plan_attention(meta.query_lens_list, meta.seq_lens_list, meta.num_decodes,
                                                  HQ, HKV, q.device, **v)
                            results.append((bench_ms(lambda: paged_attention(*args, plan)), v))
                        except Exception as e:  # e.g. out of shared memory for big tiles
                            results.append((float("inf"), dict(v, error=type(e).__name__)))
        results.sort(key=lambda r: r[0])
        print(f"sweep {name}: " + "; ".join(f"{ms:.3f} ms {v}" for ms, v in results[:4]))
        rows.append(dict(kernel="sweep", case=name, best=[dict(ms=ms, **v) for ms, v in results[:4]]))


def bench_small_ops(dtype, rows):
    from sluice_kernels.triton import reshape_and_cache as rc
    from sluice_kernels.triton import rms_norm as rn
    from sluice_kernels.triton import rotary as ro
    from sluice_kernels.triton import silu_mul as sm

    t, hidden, inter = 4096, 4096, 14336
    dev = "cuda"
    x = torch.randn(t, hidden, dtype=dtype, device=dev)
    r = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dtype, device=dev)
    gu = torch.randn(t, 2 * inter, dtype=dtype, device=dev)
    q = torch.randn(t, HQ, D, dtype=dtype, device=dev)
    k = torch.randn(t, HKV, D, dtype=dtype, device=dev)
    cos, sin = ro.cos_sin_cache(1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev) / D)), 8192)
    pos = torch.randint(0, 8192, (t,), device=dev)
    cache = torch.zeros(t // BLOCK * 2, BLOCK, HKV, D, dtype=dtype, device=dev)
    slots = torch.randperm(cache.shape[0] * BLOCK, device=dev)[:t]
    e = x.element_size()
    cases = [
        ("rms_norm+residual", lambda: rn.rms_norm(x, w, 1e-5, r), lambda: rn.rms_norm_reference(x, w, 1e-5, r),
         4 * x.numel() * e),
        ("silu_mul", lambda: sm.silu_mul(gu), lambda: sm.silu_mul_reference(gu), gu.numel() * e * 3 // 2),
        ("rotary (q, k in place)", lambda: ro.rotary_embedding_(pos, q, k, cos, sin),
         lambda: ro.rotary_embedding_reference_(pos, q, k, cos, sin), 2 * (q.numel() + k.numel()) * e),
        ("reshape_and_cache", lambda: rc.reshape_and_cache(k, k, cache, cache, slots),
         lambda: rc.reshape_and_cache_reference(k, k, cache, cache, slots), 4 * k.numel() * e),
    ]
    for name, fast, ref, nbytes in cases:
        ms, base_ms = bench_ms(fast), bench_ms(ref)
        rows.append(dict(kernel=name, case=f"T={t}", triton_ms=ms, torch_ms=base_ms, speedup=base_ms / ms,
                         gb_per_s=nbytes / (ms * 1e-3) / 1e9))


def print_table(rows, copy_bw):
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    head = f"{'kernel':<24} {'case':<28} {'triton ms':>10} {'torch ms':>10} {'speedup':>8}  extra"
    print(head)
    print("-" * len(head))
    for row in rows:
        if row["kernel"] == "sweep":
            continue
        extra = []
        if "frac_of_copy_bw" in row:
            extra.append(f"{row['gb_per_s']:.0f} GB/s = {row['frac_of_copy_bw']:.0%} of copy")
        elif "gb_per_s" in row:
            extra.append(f"{row['gb_per_s']:.0f} GB/s")
        if "tflop_per_s" in row:
            extra.append(f"{row['tflop_per_s']:.0f} TFLOP/s")
        if "num_splits" in row:
            extra.append(f"splits {row['num_splits']}")
        if "no_split_ms" in row:
            extra.append(f"unsplit {row['no_split_ms']:.3f} ms")
        if row.get("sdpa_dense_ms"):
            extra.append(f"dense SDPA {row['sdpa_dense_ms']:.3f} ms")
        if "max_abs_err" in row:
            extra.append(f"err {row['max_abs_err']:.1e}")
        print(f"{row['kernel']:<24} {row['case']:<28} {row['triton_ms']:>10.3f} {row['torch_ms']:>10.3f} "
              f"{row['speedup']:>7.2f}x  {', '.join(extra)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (none found); the kernels' correctness tests run on CPU: "
              "python -m pytest kernels/tests -q", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(repo / "kernels"), str(repo / "server")]
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth(args.copy_gib)
    rows: list[dict] = []
    decode_cases = [
        ("decode b=1 ctx=32768", [(32767, 1)]),
        ("decode b=8 ctx=8192", [(8191, 1)] * 8),
        ("decode b=64 ctx=2048", [(2047, 1)] * 64),
        ("decode b=256 ctx=1024", [(1023, 1)] * 256),
    ]
    for name, seqs in decode_cases:
        bench_attention(name, seqs, dtype, copy_bw, rows)
    prefill_cases = [
        ("prefill 4 x 2048 fresh", [(0, 2048)] * 4),
        ("chunk 512 over 8192 cached", [(8192, 512)] * 2),
        ("mixed: 32 decodes + 2x1024", [(3000, 1)] * 32 + [(0, 1024), (2048, 1024)]),
    ]
    for name, seqs in prefill_cases:
        bench_attention(name, seqs, dtype, copy_bw, rows)
    bench_small_ops(dtype, rows)
    print_table(rows, copy_bw)
    if args.sweep:
        sweep_attention(dtype, rows)
    if args.out:
        args.out.write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), dtype=args.dtype, copy_bandwidth_bytes_per_s=copy_bw, rows=rows,
        ), indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
