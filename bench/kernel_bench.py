"""Microbenchmarks of the Triton attention kernels against the memory-copy ceiling and PyTorch.

    python bench/kernel_bench.py --out bench/results/kernels_gpu.json [--sweep]

Cases (Llama-3.1-8B attention: 32 query heads, 8 kv heads, head_dim 128, bf16, block 16):
copy bandwidth (torch clone; bytes read + written) as the ceiling; paged decode at batch 64 x 4k and
1 x 32k, k=4 verification at 64 x 4k (achieved bandwidth = K/V bytes read / time); prefill (4 fresh
2k prompts, and a 2k chunk behind a 6k cached prefix) in TFLOP/s next to torch SDPA on contiguous
tensors; and the torch reference backend on the same paged inputs. Also: the model's eager RMSNorm
(+residual) and RoPE against the fused Triton kernels, and a host-side profile of the launcher.
`--sweep` also times alternative
kernel configs (tile, warps, stages, split-K) and records them, to re-tune attention_config.py.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time
from functools import partial

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

# the editable install maps kernels/ to specserve.kernels; bench/gpu_suite.sh links it on the bare machine
import specserve.kernels as K
from specserve.models.layers.attention import AttentionMetadata
from specserve.models.layers.torch_attn import TorchAttentionBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]

H, KVH, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
INTERMEDIATE = 14336  # Llama-3.1-8B MLP
DEV = torch.device("cuda")
LAYER_TOKENS = (1, 64, 256, 8192)  # decode batches and a prefill chunk


def ms(fn, graph: bool = False, rep: int = 100) -> float:
    if graph:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def make_batch(q_lens: list[int], seq_lens: list[int], seed: int = 0) -> dict:
    """Paged inputs with every request's blocks scattered over the cache (random permutation)."""
    torch.manual_seed(seed)
    per_req = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(per_req) + 8
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32, device=DEV)
    slots, used = [], 0
    for i, n in enumerate(per_req):
        tables[i, :n] = perm[used:used + n]
        used += n
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        row = tables[i].tolist()
        slots += [row[p // BS] * BS + p % BS for p in range(s - q, s)]
    num_tokens = sum(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return dict(
        query=torch.randn(num_tokens, H, D, device=DEV, dtype=DTYPE),
        key=torch.randn(num_tokens, KVH, D, device=DEV, dtype=DTYPE),
        value=torch.randn(num_tokens, KVH, D, device=DEV, dtype=DTYPE),
        kv_cache=torch.randn(2, num_blocks, BS, KVH, D, device=DEV, dtype=DTYPE),
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        q_lens=q_lens, s_lens=seq_lens, scale=D ** -0.5)


def attn_fn(b: dict, **overrides):
    out = torch.empty_like(b["query"])
    args = (b["query"], b["kv_cache"], b["query_start_loc"], b["seq_lens"], b["block_tables"], b["scale"],
            max(b["q_lens"]), max(b["s_lens"]))
    return lambda: K.paged_attention(*args, out=out, **overrides)


def torch_backend_fn(b: dict):
    meta = AttentionMetadata(
        num_reqs=len(b["q_lens"]), num_tokens=sum(b["q_lens"]), max_query_len=max(b["q_lens"]),
        max_seq_len=max(b["s_lens"]), query_start_loc=b["query_start_loc"], seq_lens=b["seq_lens"],
        block_tables=b["block_tables"], slot_mapping=b["slot_mapping"], query_lens_cpu=b["q_lens"],
        seq_lens_cpu=b["s_lens"], block_size=BS)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    return lambda: backend.forward(b["query"], b["key"], b["value"], b["kv_cache"], meta, b["scale"])


def kv_bytes(b: dict) -> int:
    return 2 * sum(b["s_lens"]) * KVH * D * b["kv_cache"].element_size()


def attn_flops(b: dict) -> float:
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(b["q_lens"], b["s_lens"]))
    return 4.0 * H * D * pairs


def bench_copy() -> dict:
    x = torch.randn(1 << 30, device=DEV, dtype=DTYPE)  # 2 GiB
    t = ms(x.clone)
    x = None
    torch.cuda.empty_cache()
    return dict(name="copy 2 GiB (torch clone)", ms=t, gbps=2 * 2 * (1 << 30) / t / 1e6)


def bench_memory_case(name: str, b: dict, copy_gbps: float, rows: list, torch_ref: bool = True) -> None:
    t = ms(attn_fn(b))
    tg = ms(attn_fn(b), graph=True)
    bw = kv_bytes(b) / tg / 1e6
    row = dict(name=name, ms=t, ms_graph=tg, kv_bytes=kv_bytes(b), gbps=bw, ratio_to_copy=bw / copy_gbps)
    if torch_ref:
        row["torch_backend_ms"] = ms(torch_backend_fn(b), rep=50)
    rows.append(row)


def bench_prefill_case(name: str, b: dict, rows: list) -> None:
    t = ms(attn_fn(b))
    row = dict(name=name, ms=t, tflops=attn_flops(b) / t / 1e9)
    if all(q == s for q, s in zip(b["q_lens"], b["s_lens"])) and len(set(b["q_lens"])) == 1:
        n, q = len(b["q_lens"]), b["q_lens"][0]  # peer: flash SDPA on contiguous, GQA-expanded tensors
        qq = torch.randn(n, H, q, D, device=DEV, dtype=DTYPE)
        kk, vv = torch.randn_like(qq), torch.randn_like(qq)
        row["sdpa_ms"] = ms(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True))
        row["sdpa_tflops"] = attn_flops(b) / row["sdpa_ms"] / 1e9
    row["torch_backend_ms"] = ms(torch_backend_fn(b), rep=50)
    rows.append(row)


def sweep(b: dict, configs: list[dict], metric, graph: bool) -> list[dict]:
    out = []
    for cfg in configs:
        try:
            t = ms(attn_fn(b, **cfg), graph=graph, rep=50)
        except Exception as exc:  # a config can exceed shared memory or registers: record and go on
            out.append(dict(cfg=_cfg_str(cfg), error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        out.append(dict(cfg=_cfg_str(cfg), ms=t, metric=metric(t)))
    return sorted(out, key=lambda r: r.get("ms", 1e9))


def _cfg_str(cfg: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


def bench_layer_ops(rows: list) -> None:
    """Eager torch RMSNorm(+residual), RoPE, SwiGLU activation (the model's basic.py) and the KV cache
    write (index_copy) vs the Triton kernels."""
    from specserve.models.layers.basic import RMSNorm, RotaryEmbedding

    hidden = H * D
    norm = RMSNorm(hidden, 1e-5).to(DEV, DTYPE)
    rope = RotaryEmbedding(D, 8192, 500000.0, None).to(DEV)
    for num_tokens in LAYER_TOKENS:
        x, res = (torch.randn(num_tokens, hidden, device=DEV, dtype=DTYPE) for _ in range(2))
        qkv = torch.randn(num_tokens, (H + 2 * KVH) * D, device=DEV, dtype=DTYPE)
        q = qkv[:, :H * D].view(num_tokens, H, D)
        k = qkv[:, H * D:(H + KVH) * D].view(num_tokens, KVH, D)
        pos = torch.randint(0, 8192, (num_tokens,), device=DEV)
        norm_bytes = 4 * x.numel() * x.element_size()  # read x, residual; write out, residual
        rope_bytes = 2 * (q.numel() + k.numel()) * q.element_size()
        gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, device=DEV, dtype=DTYPE)
        act_bytes = 3 * gate_up.numel() // 2 * gate_up.element_size()  # read gate, up; write out
        # the KV write of one layer: each token's k and v rows into random slots of a 4096-block cache
        kv_cache = torch.zeros(2, 4096, BS, KVH, D, device=DEV, dtype=DTYPE)
        key, value = (torch.randn(num_tokens, KVH, D, device=DEV, dtype=DTYPE) for _ in range(2))
        slots = torch.randperm(4096 * BS, device=DEV)[:num_tokens]
        cache_bytes = 2 * 2 * key.numel() * key.element_size()  # read k, v; write them

        def torch_cache(key=key, value=value, kv_cache=kv_cache, slots=slots):
            # what eager torch does without the kernel: an index_copy per K and V (the reference's
            # boolean mask for skipped slots would sync the host, so every slot here is valid)
            flat = kv_cache.view(2, -1, KVH, D)
            flat[0].index_copy_(0, slots, key)
            flat[1].index_copy_(0, slots, value)

        def torch_act(gate_up=gate_up):
            gate, up = gate_up.split(INTERMEDIATE, dim=-1)
            return torch.nn.functional.silu(gate) * up
        for name, fn_torch, fn_triton, nbytes in (
                ("rms_norm+residual", partial(norm, x, res), partial(K.rms_norm, x, norm.weight, 1e-5, res),
                 norm_bytes),
                ("rope q+k", partial(rope, pos, q, k), partial(K.rotary_embedding, pos, q, k, rope.cos, rope.sin),
                 rope_bytes),
                ("silu_and_mul", torch_act, partial(K.silu_and_mul, gate_up), act_bytes),
                ("reshape_and_cache", torch_cache, partial(K.reshape_and_cache, key, value, kv_cache, slots),
                 cache_bytes)):
            t_torch, t_triton = ms(fn_torch, graph=True), ms(fn_triton, graph=True)
            rows.append(dict(name=f"{name} T={num_tokens}", torch_ms_graph=t_torch, triton_ms_graph=t_triton,
                             triton_gbps=nbytes / t_triton / 1e6, speedup=t_torch / t_triton))


def host_profile(b: dict, path: pathlib.Path) -> None:
    import cProfile
    import pstats

    fn = attn_fn(b)
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    with path.open("w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)


def launcher_overhead_us(b: dict) -> float:
    fn = attn_fn(b)
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / 200 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "bench/results/kernels_gpu.json"))
    parser.add_argument("--sweep", action="store_true", help="also time alternative kernel configs")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
               triton=triton.__version__, shape=f"H={H} KVH={KVH} D={D} block={BS} {DTYPE}")
    copy = bench_copy()
    rows: list[dict] = []
    cases = dict(decode_64x4k=make_batch([1] * 64, [4096] * 64), decode_1x32k=make_batch([1], [32768]),
                 verify5_64x4k=make_batch([5] * 64, [4096] * 64))
    bench_memory_case("decode batch 64 x 4k", cases["decode_64x4k"], copy["gbps"], rows)
    bench_memory_case("decode batch 1 x 32k", cases["decode_1x32k"], copy["gbps"], rows)
    bench_memory_case("verify (1+4) batch 64 x 4k", cases["verify5_64x4k"], copy["gbps"], rows)
    prefill = dict(prefill_4x2k=make_batch([2048] * 4, [2048] * 4),
                   chunk_2k_after_6k=make_batch([2048], [8192]))
    bench_prefill_case("prefill 4 x 2k (fresh)", prefill["prefill_4x2k"], rows)
    bench_prefill_case("prefill chunk 2k after 6k prefix", prefill["chunk_2k_after_6k"], rows)
    overhead = {name: launcher_overhead_us(cases[name]) for name in ("decode_64x4k", "decode_1x32k")}
    layer_rows: list[dict] = []
    bench_layer_ops(layer_rows)
    result = dict(env=env, copy=copy, cases=rows, layer_ops=layer_rows, launcher_host_overhead_us=overhead)
    host_profile(cases["decode_1x32k"], pathlib.Path(args.out).with_suffix(".host_profile.txt"))

    if args.sweep:
        kc = K.KernelConfig
        gbps = lambda b: (lambda t: kv_bytes(b) / t / 1e6)  # noqa: E731
        tflops = lambda b: (lambda t: attn_flops(b) / t / 1e9)  # noqa: E731
        dec = [dict(short_config=kc(16, t, w, s), num_splits=1) for t in (64, 128) for w in (2, 4) for s in (3, 4)]
        result["sweep_decode_64x4k"] = sweep(cases["decode_64x4k"], dec, gbps(cases["decode_64x4k"]), True)
        result["sweep_decode_1x32k"] = sweep(
            cases["decode_1x32k"], [dict(num_splits=s) for s in (16, 32, 64, 128)], gbps(cases["decode_1x32k"]), True)
        ver = [dict(short_config=kc(32, 128, w, s)) for w in (4, 8) for s in (2, 3)]
        ver.append(dict(short_config=kc(32, 64, 4, 2)))
        result["sweep_verify5_64x4k"] = sweep(cases["verify5_64x4k"], ver, gbps(cases["verify5_64x4k"]), True)
        ver9 = make_batch([9] * 64, [4096] * 64)
        ver = [dict(short_config=kc(64, t, w, 2)) for t in (64, 128) for w in (4, 8)]
        ver.append(dict(short_config=kc(64, 128, 4, 3)))
        result["sweep_verify9_64x4k"] = sweep(ver9, ver, gbps(ver9), True)
        del ver9
        pre = [dict(long_config=kc(128, t, w, s)) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
        pre += [dict(long_config=kc(64, 64, 4, s)) for s in (2, 3)]
        result["sweep_prefill_4x2k"] = sweep(prefill["prefill_4x2k"], pre, tflops(prefill["prefill_4x2k"]), False)

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_table(result)


def print_table(result: dict) -> None:
    env, copy = result["env"], result["copy"]
    print(f"\n{env['gpu']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}, {env['shape']}")
    print(f"copy ceiling: {copy['gbps']:.0f} GB/s ({copy['name']}, {copy['ms']:.3f} ms)")
    for name, us in result["launcher_host_overhead_us"].items():
        print(f"paged_attention host launch overhead, {name}: {us:.1f} us/call")
    print()
    print("| case | triton ms (eager) | triton ms (graph) | K/V GB/s | / copy | TFLOP/s | torch backend ms | SDPA ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["cases"]:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"

        ratio = f"{100 * r['ratio_to_copy']:.0f}%" if "ratio_to_copy" in r else "-"
        print(f"| {r['name']} | {r['ms']:.4f} | {f('ms_graph', '.4f')} | {f('gbps', '.0f')} | {ratio} | "
              f"{f('tflops', '.0f')} | {f('torch_backend_ms', '.3f')} | {f('sdpa_ms', '.3f')} |")
    print("\n| layer op (CUDA graph) | torch eager ms | triton ms | triton GB/s | speedup |")
    print("|---|---|---|---|---|")
    for r in result["layer_ops"]:
        print(f"| {r['name']} | {r['torch_ms_graph']:.4f} | {r['triton_ms_graph']:.4f} | {r['triton_gbps']:.0f} | "
              f"{r['speedup']:.1f}x |")
    for key in [k for k in result if k.startswith("sweep_")]:
        print(f"\n{key} (best 5 of {len(result[key])}):")
        for r in result[key][:5]:
            print(f"  {r.get('ms', float('nan')):.4f} ms  metric {r.get('metric', float('nan')):.0f}  {r['cfg']}")
        errors = [r for r in result[key] if "error" in r]
        if errors:
            print(f"  {len(errors)} configs failed, first: {errors[0]['error']}")


if __name__ == "__main__":
    main()
