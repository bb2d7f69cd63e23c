"""Training-step throughput of the XLA path (tokens/s, MFU) for dense MLA vs DSA, on whatever backend JAX finds.

Used on a lent NVIDIA H200 (no TPU there, so the Pallas kernels are not involved):
    PYTHONPATH=. python bench/gpu_throughput.py --preset h200
and as a smoke run on CPU:
    python bench/gpu_throughput.py --preset cpu --steps 2

MFU = (training FLOPs per token from glmjax.flops, causal, matmuls only) x tokens/s / peak bf16 FLOP/s.
Needs only jax, flax, optax and numpy (no ml_collections), so it runs on the lent machine's own image.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glmjax import flops
from glmjax.config import ModelConfig
from glmjax.hardware import CHIPS
from glmjax.model import GLM, Batch

# GLM-5-proportioned: GLM-5's head and latent dims (MLA-256: nope 192 + rope 64, v 256, latent 512 + 64, indexer
# 32 x 128), fewer heads, layers and experts.
PRESETS = {
    "h200": dict(model=dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1024,
                            num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=1024,
                            kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                            n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=8, index_n_heads=32,
                            index_head_dim=128, num_nextn_predict_layers=0, dtype="bfloat16",
                            max_position_embeddings=65536, remat="full", block_q=512, loss_chunk=1024),
                 seq_lens=(4096, 8192, 16384), batch=1, peak=CHIPS["h200"].peak_bf16_flops),
    "cpu": dict(model=dict(num_nextn_predict_layers=0, block_q=64), seq_lens=(128,), batch=2, peak=None),
}


def train_step(model, tx, mode: str, B: int, S: int):
    """-> (jitted step(params, opt_state, batch) -> ((params, opt_state), loss), donating its state; the initial
    (params, opt_state); a batch of B random rows of S tokens, one document each)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest).loss(batch, mode)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    tok = jax.random.randint(jax.random.key(S), (B, S), 0, model.cfg.vocab_size, dtype=jnp.int32)
    batch = Batch(tok, jnp.ones((B, S), jnp.int32), jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))
    return jax.jit(step, donate_argnums=(0, 1)), (params, tx.init(params)), batch


def run(preset: str, steps: int, seq_lens=None, topk_ratio: int = 16):
    p = PRESETS[preset]
    rows = []
    print(f"backend={jax.default_backend()} devices={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    for S in seq_lens or p["seq_lens"]:
        for mode in ("dense", "sparse"):
            cfg = ModelConfig(**{**p["model"], "index_topk": max(S // topk_ratio, 1)})
            B = p["batch"]
            step, (params, opt_state), batch = train_step(GLM(cfg, nnx.Rngs(0)), optax.adamw(1e-4), mode, B, S)
            t0 = time.perf_counter()
            try:
                (params, opt_state), loss = step(params, opt_state, batch)
                loss.block_until_ready()
            except Exception as e:  # e.g. out of memory for dense attention at long S
                print(f"S={S} {mode}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append((S, mode, None, None, None, None))
                continue
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                (params, opt_state), loss = step(params, opt_state, batch)
                loss.block_until_ready()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            tps = B * S / med
            fmode = "dense" if mode == "dense" else "dsa_indexshare"
            fpt = flops.flops_per_token(cfg, S, "training", fmode, indexer_loss=False)["total"]
            mfu = fpt * tps / p["peak"] if p["peak"] else None
            rows.append((S, mode, compile_s, med, tps, mfu))
            print(f"S={S} {mode}: compile {compile_s:.1f}s, step {med * 1e3:.1f} ms, {tps:,.0f} tok/s, "
                  f"{fpt / 1e9:.2f} GFLOP/token, MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} "
                  f"loss {float(loss):.3f}", flush=True)
    print("\n| S | mode | step ms (median) | tokens/s | MFU | sparse speed-up |\n|---:|---|---:|---:|---:|---:|")
    for S, mode, _, med, tps, mfu in rows:
        dense = next((r for r in rows if r[0] == S and r[1] == "dense"), None)
        ratio = f"{dense[3] / med:.2f}x" if mode == "sparse" and med and dense and dense[3] else ""
        print(f"| {S} | {mode} | {'-' if med is None else f'{med * 1e3:.1f}'} | "
              f"{'-' if tps is None else f'{tps:,.0f}'} | {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {ratio} |")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-lens", type=int, nargs="*")
    a = ap.parse_args()
    run(a.preset, a.steps, a.seq_lens)
