#!/usr/bin/env python
"""Forward+backward benchmark of one GLM-5-proportioned attention layer on CPU: dense MLA vs DSA sparse.

Variants (all the same `glmjax.model.mla.MLA`, float32, batch 1, k = index_topk = S // topk_div):
  dense   Ctx(mode="dense"): causal MLA with per-head K/V expanded from the latent, by the default cost rule
          (`mla_paths.materialise`): blocked (XLA flash, O(S) memory) at these sizes.
  dense_mat  the same with the materialised [B,H,S,T] path forced (what every length ran before the blocked path).
  sparse  has_indexer=True, mode "sparse": the layer's lightning indexer picks k keys per query (top-k inside the
          timed function), attention gathers those k latent rows (MQA form).
  shared  has_indexer=False, mode "sparse": an IndexShare "shared" layer; its [B,S,k] top-k indices are an input,
          computed once by a full layer outside the timed function.

The timed function is jax.jit(jax.grad(loss, argnums=(params, x))) with loss = sum(layer(x) * cotangent) for a
fixed random cotangent. Each (S, variant) is compiled once (compile time reported separately), run `--warmup`
times, then timed `--repeats` times, the variants of one S interleaved round by round; the median is reported.
Temp memory is XLA's own number: jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes.

The layer's dims are GLM-5's divided by `--scale` (heads, LoRA ranks, head dims, indexer heads/dims, hidden):
GLM-5 = H 64, q_lora 2048, kv_lora 512, qk_nope 192, qk_rope 64, v 256, H_I 32, d_I 128, hidden 6144.

`--breakdown` additionally times the pieces of the sparse layer separately (indexer top-k, sparse attention
forward and forward+backward, the gather's backward alone, the projections, the dense attention core), see PARTS.

Quick check:   python bench/attention.py --seq-lens 1024 2048 --check
Real sizes:    python bench/attention.py --seq-lens 4096 8192 --scale 8 --block-q 128 256
Issue #15:     python bench/attention.py --seq-lens 8192 32768 --variants dense_mat dense sparse --block-q 128
               (dense_mat is skipped where its f32 [H,S,S] scores alone exceed MemAvailable, e.g. S = 32768)
(--scale 4 is the closer proportion, but its dense layer needs 20.7 GB of temp memory at S=8192; configurations
that do not fit in --max-mem-frac of MemAvailable are compiled and reported, not run. See docs/benchmarks.md.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's glmjax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from glmjax.config import ModelConfig  # noqa: E402
from glmjax.model.backends import BACKENDS, Backend  # noqa: E402
from glmjax.model.indexer import index_logits, index_topk, visible  # noqa: E402
from glmjax.model.layers import rope_tables  # noqa: E402
from glmjax.model import mla_paths  # noqa: E402
from glmjax.model.latent_attention import dense_mla  # noqa: E402
from glmjax.model.mla import MLA, Ctx  # noqa: E402
from glmjax.model.sparse_attention import sparse_mla_xla  # noqa: E402

GLM5 = dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
            qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128)
VARIANTS = ("dense_mat", "dense", "sparse", "shared")
MB = 1024 * 1024
COMPILE_ONLY = False  # set by --compile-only: report compile time and temp memory, execute nothing


# ------------------------------------------------------------------------------------------------ setup


def layer_config(seq_len: int, scale: int, block_q: int, topk_div: int) -> ModelConfig:
    dims = {}
    for name, full in GLM5.items():
        if full % scale:
            raise SystemExit(f"--scale {scale}: GLM-5 {name}={full} is not divisible by it")
        dims[name] = full // scale
    if dims["qk_rope_head_dim"] % 2:
        raise SystemExit(f"--scale {scale}: qk_rope_head_dim={dims['qk_rope_head_dim']} must stay even")
    return ModelConfig(
        **dims,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        index_topk=max(1, seq_len // topk_div),
        block_q=block_q,
        dtype="float32",
        param_dtype="float32",
        rope_theta=1e6,
        max_position_embeddings=max(seq_len, 256),
    )


def inputs(cfg: ModelConfig, seq_len: int, seed: int = 0):
    """x [1,S,D] (stands in for the normed hidden state), cotangent [1,S,D], RoPE tables, one segment."""
    kx, kc = jax.random.split(jax.random.key(seed))
    D = cfg.hidden_size
    x = jax.random.normal(kx, (1, seq_len, D), jnp.float32)
    ct = jax.random.normal(kc, (1, seq_len, D), jnp.float32)
    positions = jnp.arange(seq_len, dtype=jnp.int32)[None]
    cos, sin = rope_tables(positions, cfg)
    seg = jnp.ones((1, seq_len), jnp.int32)
    return x, ct, cos, sin, seg


def split_layer(cfg: ModelConfig, has_indexer: bool):
    """-> graphdef, params (nnx.Param state), rest (other state, normally empty)."""
    mla = MLA(cfg, has_indexer, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(mla, nnx.Param, ...)
    return graphdef, params, rest


def grad_fn(graphdef, rest, mode: str, backend: Backend | None = None):
    """f(params, x, cos, sin, seg, topk, ct) -> (d params, d x) of sum(layer(x) * ct); backend: see Ctx."""

    def loss(params, x, cos, sin, seg, topk, ct):
        out = nnx.merge(graphdef, params, rest)(x, Ctx(cos, sin, seg, mode, backend=backend), topk)[0]  # (out, ..)
        return jnp.sum(out * ct)

    return jax.grad(loss, argnums=(0, 1))


def precomputed_topk(cfg, x, cos, sin, seg):
    """The [B,S,k] indices a preceding full layer hands to a shared layer (computed once, outside any timing)."""
    graphdef, params, rest = split_layer(cfg, has_indexer=True)

    @jax.jit
    def run(params, x, cos, sin, seg):
        layer = nnx.merge(graphdef, params, rest)
        empty = jnp.zeros(x.shape[:2] + (0,), jnp.int32)
        return layer(x, Ctx(cos, sin, seg, "sparse"), empty)[1]  # (out, topk used, ...)

    return jax.block_until_ready(run(params, x, cos, sin, seg))


# ------------------------------------------------------------------------------------------------ timing


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def measure(fn, args, repeats: int, warmup: int, max_mem_frac: float, name: str):
    """Compile fn(*args) once, then time it. -> dict(compile_s, times, median_s, temp_bytes, ... )."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    temp = int(ma.temp_size_in_bytes)
    arg_b, out_b = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    res = dict(compile_s=compile_s, temp_bytes=temp, argument_bytes=arg_b, output_bytes=out_b,
               times=[], median_s=None, min_s=None, cpu_median_s=None, skipped=None)
    need, avail = temp + out_b, mem_available()
    if COMPILE_ONLY:
        res["skipped"] = "--compile-only"
        print(f"  [{name}] compile {compile_s:.1f}s, temp {temp / MB:.0f} MB (compile only)", flush=True)
        return res
    if need > max_mem_frac * avail:
        res["skipped"] = (f"needs {need / MB:.0f} MB temp+output, only {avail / MB:.0f} MB available "
                          f"(limit {max_mem_frac:.0%})")
        print(f"  [{name}] compile {compile_s:.1f}s, temp {temp / MB:.0f} MB -- NOT RUN: {res['skipped']}",
              flush=True)
        return res
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    res["cpu_times"], res["load_before"] = [], os.getloadavg()[0]
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args))
        res["times"].append(time.perf_counter() - t)
        res["cpu_times"].append(time.process_time() - c)
    res["load_after"] = os.getloadavg()[0]
    res["median_s"] = statistics.median(res["times"])
    res["min_s"] = min(res["times"])
    res["cpu_median_s"] = statistics.median(res["cpu_times"])
    times = ", ".join(f"{t:.3f}" for t in res["times"])
    print(f"  [{name}] compile {compile_s:.1f}s, temp {temp / MB:.0f} MB, runs [{times}] s -> median "
          f"{res['median_s']:.3f}s (process CPU {res['cpu_median_s']:.3f}s; load avg {res['load_before']:.1f}"
          f" -> {res['load_after']:.1f})", flush=True)
    return res


def compile_one(fn, args, name: str):
    """-> (compiled, result dict with compile time and XLA's memory numbers)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    ma = compiled.memory_analysis()
    return compiled, dict(name=name, compile_s=time.perf_counter() - t0, temp_bytes=int(ma.temp_size_in_bytes),
                          argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
                          times=[], cpu_times=[], median_s=None, min_s=None, cpu_median_s=None, skipped=None)


def measure_interleaved(items, repeats: int, warmup: int, max_mem_frac: float) -> list[dict]:
    """items: [(name, fn, args)] -> one result per item; all compiled first, then timed round-robin (round r times
    every item once), so load changes hit every variant alike."""
    runs = []
    for name, fn, args in items:
        compiled, res = compile_one(fn, args, name)
        need, avail = res["temp_bytes"] + res["output_bytes"], mem_available()
        if COMPILE_ONLY:
            res["skipped"] = "--compile-only"
        elif need > max_mem_frac * avail:
            res["skipped"] = f"needs {need / MB:.0f} MB temp+output, only {avail / MB:.0f} MB available"
        print(f"  [{name}] compile {res['compile_s']:.1f}s, temp {res['temp_bytes'] / MB:.0f} MB"
              + (f" -- NOT RUN: {res['skipped']}" if res["skipped"] else ""), flush=True)
        runs.append((compiled, args, res))
    live = [(c, a, r) for c, a, r in runs if not r["skipped"]]
    for c, a, r in live:
        for _ in range(warmup):
            jax.block_until_ready(c(*a))
        r["load_before"] = os.getloadavg()[0]
    for i in range(repeats):
        for c, a, r in live:
            t, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(c(*a))
            r["times"].append(time.perf_counter() - t)
            r["cpu_times"].append(time.process_time() - cpu)
            print(f"  [{r['name']}] round {i}: {r['times'][-1]:.3f}s (load {os.getloadavg()[0]:.1f})", flush=True)
    for c, a, r in live:
        r.update(load_after=os.getloadavg()[0], median_s=statistics.median(r["times"]), min_s=min(r["times"]),
                 cpu_median_s=statistics.median(r["cpu_times"]))
    return [r for _, _, r in runs]


def layer_case(seq_len: int, variant: str, block_q: int, args):
    """-> (label, fn, fn args, cfg) of one (S, variant, block_q) whole-layer case."""
    cfg = layer_config(seq_len, args.scale, block_q, args.topk_div)
    x, ct, cos, sin, seg = inputs(cfg, seq_len)
    if variant in ("dense", "dense_mat"):
        graphdef, params, rest = split_layer(cfg, has_indexer=False)
        topk = jnp.zeros((1, seq_len, 0), jnp.int32)  # unused in dense mode
        mode = "dense"
    elif variant == "sparse":
        graphdef, params, rest = split_layer(cfg, has_indexer=True)
        topk = jnp.zeros((1, seq_len, 0), jnp.int32)  # the layer computes its own
        mode = "sparse"
    elif variant == "shared":
        if COMPILE_ONLY:  # only the shape matters
            topk = jnp.zeros((1, seq_len, min(cfg.index_topk, seq_len)), jnp.int32)
        else:
            topk = precomputed_topk(cfg, x, cos, sin, seg)
        graphdef, params, rest = split_layer(cfg, has_indexer=False)
        mode = "sparse"
    else:
        raise ValueError(variant)
    fn = grad_fn(graphdef, rest, mode)
    if variant == "dense_mat":
        fn = materialised(fn)
    label = variant if variant.startswith("dense") or len(args.block_q) == 1 else f"{variant} bq={block_q}"
    return label, fn, (params, x, cos, sin, seg, topk, ct), cfg


def materialised(fn):
    """fn traced with the materialised dense path forced (`mla_paths.LIMITS.materialise_scores` = inf)."""
    def wrapped(*a):
        saved = mla_paths.LIMITS
        mla_paths.LIMITS = mla_paths.Limits(materialise_scores=float("inf"))
        try:
            return fn(*a)
        finally:
            mla_paths.LIMITS = saved
    return wrapped


def bench_seq_len(seq_len: int, args) -> list[dict]:
    """Every requested variant (and block_q) at one S, timed interleaved."""
    H = GLM5["num_attention_heads"] // args.scale
    variants = [v for v in args.variants if v != "dense_mat" or 4 * H * seq_len ** 2 <= mem_available()]
    if variants != args.variants:
        print(f"  [S={seq_len} dense_mat] skipped: its f32 [H,S,S] scores alone exceed the available memory")
    cases = [layer_case(seq_len, v, bq, args) for v in variants
             for bq in (args.block_q[:1] if v.startswith("dense") else args.block_q)]
    results = measure_interleaved([(f"S={seq_len} {label}", fn, fargs) for label, fn, fargs, _ in cases],
                                  args.repeats, args.warmup, args.max_mem_frac)
    for res, (label, _, _, cfg) in zip(results, cases):
        res.update(seq_len=seq_len, variant=label.split()[0], label=label, k=cfg.index_topk, block_q=cfg.block_q)
    return results


# ------------------------------------------------------------------------------------------------ breakdown


PARTS = {
    "indexer": "indexer+topk fwd: the indexer projections + glmjax index_topk (what sparse adds over shared)",
    "scores": "index scores fwd: index_topk's blocked masked scores reduced with max() instead of top_k",
    "topk": "lax.top_k only: lax.top_k(., k) on precomputed [block_q, T] score blocks, mapped over S/block_q",
    "sparse_fwd": "sparse attn fwd: sparse_mla_xla forward only (gather + softmax + PV)",
    "sparse_fb": "sparse attn fwd+bwd: grad of sum(out * ct) w.r.t. (q_abs, latent) through sparse_mla_xla",
    "gather_bwd": "gather bwd: grad w.r.t. the cache of sum(gathered rows * ct), blocked like sparse_mla",
    "layer_fwd": "shared layer fwd: the IndexShare layer forward only (no grad)",
    "proj_fb": "shared layer fwd+bwd, attention stubbed: projections/RoPE/absorption only",
    "dense_core": "dense attn fwd+bwd: grad through glmjax dense_mla alone ([B,H,S,T] core, no projections)",
}


def stub_sparse_attention(q, kv, indices, *, scale, kv_lora_rank, block_q):
    """Stand-in for sparse_mla_xla with the same shapes and O(S) cost: isolates the rest of the layer."""
    return q[..., :kv_lora_rank] * scale, jnp.zeros(q.shape[:3], jnp.float32)


def breakdown(seq_len: int, block_q: int, args) -> list[dict]:
    """Time the pieces of the sparse layer (and the dense core) separately, at the shapes the layer uses (PARTS)."""
    cfg = layer_config(seq_len, args.scale, block_q, args.topk_div)
    x, ct, cos, sin, seg = inputs(cfg, seq_len)
    S, k, bq = seq_len, cfg.index_topk, min(cfg.block_q, seq_len)
    H, R, dr, dn, dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                        cfg.v_head_dim)
    C, nb, sm = R + dr, S // bq, cfg.softmax_scale
    graphdef, params, rest = split_layer(cfg, has_indexer=True)
    layer = nnx.merge(graphdef, params, rest)
    keys = jax.random.split(jax.random.key(1), 8)
    out = []

    def run(part, fn, *fargs):
        if part not in args.parts:
            return
        res = measure(fn, fargs, args.repeats, args.warmup, args.max_mem_frac, f"S={S} bq={bq} {part}")
        res.update(seq_len=S, block_q=bq, part=part, what=PARTS[part])
        out.append(res)

    # Indexer inputs exactly as the layer makes them.
    q_resid = layer.q_a_layernorm(jnp.einsum("bsd,dr->bsr", x, layer.q_a_proj[...]))
    idx_graph, idx_state = nnx.split(layer.indexer)

    def indexer_topk(state, x, q_resid, cos, sin, seg):
        qi, ki, wi = nnx.merge(idx_graph, state)(x, q_resid, cos, sin)
        return index_topk(qi, ki, wi, seg, seg, k, bq)[0]

    run("indexer", indexer_topk, idx_state, x, q_resid, cos, sin, seg)
    qi, ki, wi = jax.jit(lambda st, *a: nnx.merge(idx_graph, st)(*a))(idx_state, x, q_resid, cos, sin)

    def score_blocks(qi, ki, wi, seg):
        def one(a):
            qb, wb, segb, idxb = a
            s = jnp.where(visible(segb, seg, idxb), index_logits(qb, ki, wb), -jnp.inf)
            return jnp.max(s, axis=-1)

        blk = lambda a: jnp.moveaxis(a.reshape((1, nb, bq) + a.shape[2:]), 1, 0)
        return jax.lax.map(one, (blk(qi), blk(wi), blk(seg), jnp.arange(S).reshape(nb, bq)))

    run("scores", score_blocks, qi, ki, wi, seg)
    scores = jax.random.normal(keys[0], (nb, bq, S), jnp.float32)
    run("topk", lambda sc: jax.lax.map(lambda b: jax.lax.top_k(b, k), sc), scores)

    topk = jax.jit(index_topk, static_argnums=(5, 6))(qi, ki, wi, seg, seg, k, bq)[0]
    q_abs = jax.random.normal(keys[1], (1, S, H, C), jnp.float32) * 0.1
    latent = jax.random.normal(keys[2], (1, S, C), jnp.float32)
    ct_lat = jax.random.normal(keys[3], (1, S, H, R), jnp.float32)

    def sparse_fwd(q, kv, ids):
        return sparse_mla_xla(q, kv, ids, scale=sm, kv_lora_rank=R, block_q=bq)[0]

    def sparse_fb(q, kv, ids, c):
        return jax.grad(lambda q, kv: jnp.sum(sparse_fwd(q, kv, ids) * c), argnums=(0, 1))(q, kv)

    run("sparse_fwd", sparse_fwd, q_abs, latent, topk)
    run("sparse_fb", sparse_fb, q_abs, latent, topk, ct_lat)

    def gather_bwd(kv, ids, c):
        def f(kv):
            def one(a):
                ib, cb = a
                rows = jax.vmap(lambda cache, i: cache[i])(kv, jnp.maximum(ib, 0))
                return jnp.sum(rows * cb)

            return jnp.sum(jax.lax.map(one, (jnp.moveaxis(ids.reshape(1, nb, bq, k), 1, 0), c)))

        return jax.grad(f)(kv)

    if "gather_bwd" in args.parts:
        run("gather_bwd", gather_bwd, latent, topk, jax.random.normal(keys[4], (nb, 1, bq, k, C), jnp.float32))

    sg, sp, sr = split_layer(cfg, has_indexer=False)

    def shared_fwd(p, x, cos, sin, seg, ids):
        return nnx.merge(sg, p, sr)(x, Ctx(cos, sin, seg, "sparse"), ids)[0]

    run("layer_fwd", shared_fwd, sp, x, cos, sin, seg, topk)
    if "proj_fb" in args.parts:
        stub = BACKENDS[cfg.attention_impl]._replace(sparse_mla=stub_sparse_attention)
        run("proj_fb", grad_fn(sg, sr, "sparse", stub), sp, x, cos, sin, seg, topk, ct)

    q_nope = jax.random.normal(keys[5], (1, S, H, dn), jnp.float32) * 0.1
    q_pe = jax.random.normal(keys[6], (1, S, H, dr), jnp.float32) * 0.1
    w_uk, w_uv = layer.kv_b_proj[...][..., :dn], layer.kv_b_proj[...][..., dn:]
    ct_v = jax.random.normal(keys[7], (1, S, H, dv), jnp.float32)

    def dense_fb(qn, qp, ckv, kpe, c):
        def f(*a):
            o = dense_mla(*a, w_uk, w_uv, seg, sm)
            return jnp.sum((o[0] if isinstance(o, tuple) else o) * c)  # newer glmjax also returns the max logit

        return jax.grad(f, argnums=(0, 1, 2, 3))(qn, qp, ckv, kpe)

    run("dense_core", dense_fb, q_nope, q_pe, latent[..., :R], latent[..., R:], ct_v)
    return out


def check(seq_len: int, block_q: int, args) -> str:
    """Sanity check of the setup: the shared layer fed the full layer's indices must give the full layer's gradients
    (same weights: both built from nnx.Rngs(0), the indexer is created last), and sparse with k = S equals dense."""
    cfg = layer_config(seq_len, args.scale, block_q, args.topk_div)
    x, ct, cos, sin, seg = inputs(cfg, seq_len)
    empty = jnp.zeros((1, seq_len, 0), jnp.int32)
    gf, pf, rf = split_layer(cfg, has_indexer=True)
    gs, ps, rs = split_layer(cfg, has_indexer=False)
    topk = precomputed_topk(cfg, x, cos, sin, seg)
    dpf, dxf = jax.jit(grad_fn(gf, rf, "sparse"))(pf, x, cos, sin, seg, empty, ct)
    dps, dxs = jax.jit(grad_fn(gs, rs, "sparse"))(ps, x, cos, sin, seg, topk, ct)
    del dpf["indexer"]
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves((dpf, dxf)), jax.tree.leaves((dps, dxs))))
    cfg_all = cfg.replace(index_topk=seq_len)
    ga, pa, ra = split_layer(cfg_all, has_indexer=True)
    f = jax.jit(lambda p, mode: nnx.merge(ga, p, ra)(x, Ctx(cos, sin, seg, mode), empty)[0], static_argnums=1)
    dense_err = float(jnp.max(jnp.abs(f(pa, "sparse") - f(pa, "dense"))))
    ok = err < 1e-5 and dense_err < 1e-5
    return (f"check S={seq_len} bq={block_q}: shared-vs-sparse grad max|diff| {err:.2e}, sparse(k=S)-vs-dense out "
            f"max|diff| {dense_err:.2e} -> {'OK' if ok else 'MISMATCH'}")


# ------------------------------------------------------------------------------------------------ report


def load(r):
    """1-minute load average before -> after the timed runs (2 cores: anything above ~2 means contention)."""
    return f"{r['load_before']:.1f}->{r['load_after']:.1f}" if r.get("load_before") is not None else "-"


def fmt_s(v):
    return "-" if v is None else f"{v:.3f}"


def table(results: list[dict], seq_lens) -> str:
    labels = list(dict.fromkeys(r["label"] for r in results))
    by = {(r["seq_len"], r["label"]): r for r in results}
    lines = ["| S | k | variant | compile s | median s | min s | CPU s (median) | dense/variant | temp MB | load avg |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for S in seq_lens:
        dense = by.get((S, "dense"))
        for v in labels:
            if (S, v) not in by:
                continue
            r = by[(S, v)]
            med = r["median_s"]
            ratio = "-"
            if dense and dense["median_s"] and med:
                ratio = f"{dense['median_s'] / med:.2f}x"
            note = f" (not run: {r['skipped']})" if r["skipped"] else ""
            lines.append(f"| {S} | {r['k']} | {v}{note} | {r['compile_s']:.1f} | {fmt_s(med)} | {fmt_s(r['min_s'])} "
                         f"| {fmt_s(r['cpu_median_s'])} | {ratio} | {r['temp_bytes'] / MB:.1f} | {load(r)} |")
    if len(seq_lens) >= 2:
        lines += ["", "| variant | S | temp-memory growth | median-time growth |", "|---|---|---:|---:|"]
        for v in labels:
            for a, b in zip(seq_lens[:-1], seq_lens[1:]):
                if (a, v) not in by or (b, v) not in by:
                    continue
                ra, rb = by[(a, v)], by[(b, v)]
                mem = rb["temp_bytes"] / ra["temp_bytes"] if ra["temp_bytes"] else float("nan")
                tg = (f"{rb['median_s'] / ra['median_s']:.2f}x" if ra["median_s"] and rb["median_s"] else "-")
                lines.append(f"| {v} | {a}->{b} | {mem:.2f}x | {tg} |")
    return "\n".join(lines)


def breakdown_table(parts: list[dict]) -> str:
    lines = ["| S | block_q | part | what | compile s | median s | min s | CPU s (median) | temp MB | load avg |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in parts:
        lines.append(f"| {r['seq_len']} | {r['block_q']} | {r['part']} | {r['what'].split(':')[0]} "
                     f"| {r['compile_s']:.1f} | {fmt_s(r['median_s'])} | {fmt_s(r['min_s'])} "
                     f"| {fmt_s(r['cpu_median_s'])} | {r['temp_bytes'] / MB:.1f} | {load(r)} |")
    return "\n".join(lines)


def targets(results: list[dict], seq_lens) -> list[str]:
    """Issue #15's targets: blocked dense >= 2x faster than materialised dense at S = 8192; sparse (full indexer)
    >= 3x faster than blocked dense at S = 32,768 (medians of one interleaved run)."""
    by = {(r["seq_len"], r["label"]): r["median_s"] for r in results}
    msgs = []
    for S, fast, slow, goal in ((8192, "dense", "dense_mat", 2.0), (32768, "sparse", "dense", 3.0)):
        if by.get((S, fast)) and by.get((S, slow)):
            r = by[(S, slow)] / by[(S, fast)]
            msgs.append(f"target: {fast} >= {goal:g}x faster than {slow} at S={S}: {r:.2f}x -> "
                        f"{'MET' if r >= goal else 'NOT MET'}")
    return msgs


def code_state() -> str:
    """git HEAD of the repo + a fingerprint of uncommitted changes under glmjax/ (the code is a moving target)."""
    import hashlib
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "glmjax"], cwd=root, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "git state unknown"
    dirty = f" + uncommitted glmjax/ diff sha1 {hashlib.sha1(diff).hexdigest()[:10]}" if diff else " (clean)"
    return f"git {head}{dirty}"


def machine() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"nproc={os.cpu_count()}, CPU: {model}, jax {jax.__version__}, backend {jax.default_backend()}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--scale", type=int, default=8,
                   help="divide GLM-5's attention dims by this (default 8: the largest whose dense layer runs at "
                        "S=8192 in 24 GB)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compilation")
    p.add_argument("--block-q", type=int, nargs="+", default=[256],
                   help="ModelConfig.block_q (query block of the indexer top-k and the sparse attention); several "
                        "values run the sparse variants once per value (dense does not use it). Default 256 = "
                        "the ModelConfig default")
    p.add_argument("--topk-div", type=int, default=16, help="index_topk = S // this (default 16)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--breakdown", action="store_true", help="also time the sparse layer's pieces separately")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                   help="which pieces --breakdown times (default all): " + "; ".join(PARTS.values()))
    p.add_argument("--no-layer", action="store_true", help="skip the whole-layer table (with --breakdown)")
    p.add_argument("--compile-only", action="store_true", help="only compile: compile time and temp memory")
    p.add_argument("--check", action="store_true",
                   help="first verify the setup at the smallest S (shared == sparse gradients; sparse k=S == dense)")
    p.add_argument("--max-mem-frac", type=float, default=0.8,
                   help="do not execute a configuration whose temp+output exceeds this fraction of MemAvailable")
    p.add_argument("--json", help="also write all results to this JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    for S in args.seq_lens:
        for bq in args.block_q:
            if bq < 1 or S % min(bq, S):
                p.error(f"--seq-lens {S} must be a multiple of --block-q {bq}")
    global COMPILE_ONLY
    COMPILE_ONLY = args.compile_only

    cfg0 = layer_config(args.seq_lens[0], args.scale, args.block_q[0], args.topk_div)
    print(f"# {machine()}")
    print(f"# code: {code_state()}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"# layer: GLM-5 / {args.scale}: D={cfg0.hidden_size} H={cfg0.num_attention_heads} "
          f"q_lora={cfg0.q_lora_rank} kv_lora={cfg0.kv_lora_rank} nope={cfg0.qk_nope_head_dim} "
          f"rope={cfg0.qk_rope_head_dim} v={cfg0.v_head_dim} H_I={cfg0.index_n_heads} d_I={cfg0.index_head_dim}; "
          f"B=1, float32, k=S/{args.topk_div}, block_q={args.block_q}; warmup {args.warmup}, "
          f"median of {args.repeats}")
    print(f"# command: python {' '.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))}",
          flush=True)

    if args.check:
        print(check(min(args.seq_lens), args.block_q[0], args), flush=True)
    results, parts = [], []
    if not args.no_layer:
        for S in args.seq_lens:
            results += bench_seq_len(S, args)
    if args.breakdown:
        for S in args.seq_lens:
            for bq in args.block_q:
                parts += breakdown(S, bq, args)

    if results:
        print()
        print(table(results, args.seq_lens))
        for m in targets(results, args.seq_lens):
            print(m)
    if parts:
        print()
        print(breakdown_table(parts))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(machine=machine(), code=code_state(), args=vars(args), layer=results, breakdown=parts),
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
