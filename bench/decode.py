"""Batched decode throughput (tokens/s) at a given context, dense vs sparse (DSA) attention, on CPU.

    python bench/decode.py [--config configs/small.py] [--contexts 2048 8192] [--batch 8] [--steps 16]

The cache is filled by chunked prefill (`Decoder.extend`) to `context` tokens, then `--steps` single-token decode
steps are timed (median). Dense decode attends over every cached latent row; sparse decode runs the indexer over
the cached indexer keys (full layers only) and gathers index_topk latent rows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.flops import load_model_config
from glmjax.infer import Decoder
from glmjax.model import GLM


def bench(cfg: ModelConfig, context: int, batch: int, steps: int, mode: str, chunk: int = 512):
    model = GLM(cfg, nnx.Rngs(0))
    dec = Decoder(model, mode)
    caches = dec.init_cache(batch, context + steps + 1)
    key = jax.random.key(context)
    t0 = time.perf_counter()
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        tok = jax.random.randint(jax.random.fold_in(key, start), (batch, n), 0, cfg.vocab_size, jnp.int32)
        logits, caches = dec.extend(dec.state, tok, jnp.full((batch,), start, jnp.int32), caches)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - t0
    lengths = jnp.full((batch,), context, jnp.int32)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    times = []
    for i in range(steps + 1):  # the first call compiles
        t0 = time.perf_counter()
        logits, caches = dec.decode(dec.state, tok, lengths, caches)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        tok.block_until_ready()
        if i:
            times.append(time.perf_counter() - t0)
        lengths = lengths + 1
    step = statistics.median(times)
    return prefill_s, step, batch / step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/small.py")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    cfg = load_model_config(a.config).replace(max_position_embeddings=max(a.contexts) + a.steps + 1)
    print(f"{a.config}: batch {a.batch}, index_topk {cfg.index_topk}, backend {jax.default_backend()}")
    rows = []
    for ctx in a.contexts:
        for mode in ("dense", "sparse"):
            prefill_s, step, tps = bench(cfg, ctx, a.batch, a.steps, mode)
            rows.append((ctx, mode, step, tps, prefill_s))
            print(f"context {ctx} {mode}: {step * 1e3:.1f} ms/step, {tps:.1f} tokens/s "
                  f"(prefill+compile {prefill_s:.1f} s)", flush=True)
    print("\n| context | mode | ms / decode step (median) | tokens/s | sparse / dense tokens/s |")
    print("|---:|---|---:|---:|---:|")
    for ctx, mode, step, tps, _ in rows:
        dense = next(r for r in rows if r[0] == ctx and r[1] == "dense")
        print(f"| {ctx} | {mode} | {step * 1e3:.1f} | {tps:.1f} | {tps / dense[3]:.2f}x |" if mode == "sparse"
              else f"| {ctx} | {mode} | {step * 1e3:.1f} | {tps:.1f} | |")


if __name__ == "__main__":
    main()
