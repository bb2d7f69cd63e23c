"""glmjax against Hugging Face transformers on one GPU: the train step (forward + backward + AdamW) of one model.

    python bench/gpu_peers.py                           # h200 preset: S 4096 / 8192 / 16384, dense + sparse, parts
    python bench/gpu_peers.py --preset cpu --reps 1     # smoke run on CPU (tiny model, S 128)
    python bench/gpu_peers.py --set dense_attention_impl=xla --set moe_impl=blocked   # glmjax's previous GPU paths

The model is `bench/gpu_throughput.py`'s preset (GLM-5 head and latent dims, D 2048, 8 layers, 64 experts / 8
active) with index_topk = S / 16; transformers builds `GlmMoeDsaForCausalLM` from the same config
(`glmjax.interop.keymap.config_to_hf`), bf16, sdpa attention, grouped_mm experts where transformers has them; both
parameter counts are printed. Batch 1, one document per row. Precision differs as each library trains by default:
glmjax keeps f32 parameters and AdamW state and computes in bf16, transformers holds everything in bf16. For each S
in turn, each side runs in its own process (JAX and torch would compete for the GPU's memory), glmjax first. Every
row is printed and appended to --out (JSON lines) as it is measured, so a run cut short keeps what it measured; the
tables come at the end. JAX's compilation cache ($JAX_COMPILATION_CACHE_DIR, default /tmp/gpu_peers_jax_cache)
makes a rerun cheaper.

  glmjax      the trainer's loss (`GLM.loss`, dense or sparse attention, the model's remat) under jit, AdamW (optax)
  transformers  model(ids, labels=ids).loss.backward(), torch.optim.AdamW.step() (no gradient checkpointing)
  parts       (glmjax, at the first S) each jitted alone, forward + backward: one MLA layer dense and sparse, one MoE
              layer, the LM-head loss, and the AdamW update of the whole model; "per step" = x the layer count

Reported: median milliseconds of --reps calls after one warm-up call (compile), and transformers / glmjax ratios.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
REPLY = "@@"  # rows a worker prints start with this; anything else is passed through


def median_ms(fn, reps: int, sync) -> float:
    """fn() once to warm up (compile), then the median of `reps` timed calls (sync(result) waits for the device)."""
    sync(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def emit(row: dict, out: str | None):
    print(REPLY + json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def value(text: str):
    """A --set value: a Python literal (4, 0.5, True), else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def model_config(args, S: int):
    """The preset's model at S (index_topk = S / 16), with the --set overrides."""
    from gpu_throughput import PRESETS

    from glmjax.config import ModelConfig
    sets = {k: value(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    return ModelConfig(**{**PRESETS[args.preset]["model"], "index_topk": max(S // 16, 1), **sets})


# ------------------------------------------------------------------------------------------------ glmjax side

def glmjax_worker(args) -> None:
    import jax
    import optax
    from gpu_throughput import train_step

    from flax import nnx

    from glmjax.model import GLM
    from glmjax.train.step import count_params

    jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                                  "/tmp/gpu_peers_jax_cache"))
    print(f"glmjax: backend {jax.default_backend()}, {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for S in args.seq_lens:
        for mode in ("dense", "sparse"):
            cfg = model_config(args, S)
            model = GLM(cfg, nnx.Rngs(0))
            n = count_params(nnx.state(model, nnx.Param))
            step, state, batch = train_step(model, optax.adamw(1e-4), mode, 1, S)
            holder = {"state": state}

            def call():
                holder["state"], loss = step(*holder["state"], batch)
                return loss

            try:
                ms = median_ms(call, args.reps, lambda loss: loss.block_until_ready())
                emit({"impl": "glmjax", "S": S, "mode": mode, "ms": ms, "params": n}, args.out)
            except Exception as e:  # e.g. out of memory, a kernel that does not lower
                print(f"glmjax S={S} {mode}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            finally:
                del holder, model, state
        if args.parts and S == args.seq_lens[0]:
            for name, part in glmjax_parts(args, S):
                try:
                    emit(part(), args.out)
                except Exception as e:
                    print(f"glmjax part {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def glmjax_parts(args, S: int):
    """(name, a call -> row {part, ms (one call), per_step (x layers)}) for the parts of the step at S (module
    doc); each part builds what it needs when called."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from glmjax.model import GLM
    from glmjax.model.layers import rope_tables
    from glmjax.model.mla import MLA, Ctx
    from glmjax.model.moe import MoE
    from glmjax.model.transformer import token_nll

    cfg = model_config(args, S)
    dt = jnp.dtype(cfg.dtype)
    x = jax.random.normal(jax.random.key(0), (1, S, cfg.hidden_size), dt)
    seg = jnp.ones((1, S), jnp.int32)
    cos, sin = rope_tables(jnp.arange(S)[None], cfg)
    sync = lambda out: jax.block_until_ready(out)  # noqa: E731
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace

    def grad_ms(module, loss):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        g = jax.jit(jax.grad(lambda p, x: loss(nnx.merge(graphdef, p, rest), x), argnums=(0, 1)))
        return median_ms(lambda: g(params, x), args.reps, sync)

    def row(part, ms, layers):
        return {"impl": "glmjax", "S": S, "part": part, "ms": ms, "per_step": ms * layers}

    def mla(mode):
        loss = lambda m, x: jnp.sum(m(x, Ctx(cos, sin, seg, mode), jnp.zeros((1, S, 0), jnp.int32))[0]  # noqa: E731
                                    .astype(jnp.float32))
        return row(f"MLA {mode}", grad_ms(MLA(cfg, True, nnx.Rngs(0)), loss), cfg.num_hidden_layers)

    def moe():
        return row("MoE", grad_ms(MoE(cfg, nnx.Rngs(0)), lambda m, x: jnp.sum(m(x)[0].astype(jnp.float32))), n_moe)

    def lm_loss():
        model = GLM(cfg, nnx.Rngs(0))
        targets = jax.random.randint(jax.random.key(1), (1, S), 0, cfg.vocab_size)
        head = nnx.Dict({"norm": model.norm, "lm_head": model.lm_head})
        return row("LM-head loss", grad_ms(head, lambda m, x: jnp.sum(
            token_nll(m["norm"](x), m["lm_head"][...], targets, cfg.loss_chunk))), 1)

    def adamw():
        params = nnx.state(GLM(cfg, nnx.Rngs(0)), nnx.Param)
        tx = optax.adamw(1e-4)
        opt = tx.init(params)
        update = jax.jit(lambda g, o, p: optax.apply_updates(p, tx.update(g, o, p)[0]))
        return row("AdamW", median_ms(lambda: update(params, opt, params), args.reps, sync), 1)

    return [("MLA dense", lambda: mla("dense")), ("MLA sparse", lambda: mla("sparse")), ("MoE", moe),
            ("LM-head loss", lm_loss), ("AdamW", adamw)]


# ------------------------------------------------------------------------------------------------ transformers side

def transformers_worker(args) -> None:
    import torch
    import transformers

    from glmjax.interop.keymap import config_to_hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}", flush=True)
    for S in args.seq_lens:
        cfg = model_config(args, S)
        hf = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
        config = transformers.GlmMoeDsaConfig(**hf)
        build = functools.partial(transformers.GlmMoeDsaForCausalLM._from_config, config, dtype=dtype,
                                  attn_implementation="sdpa")
        with torch.device(device):  # built in place, in its dtype
            try:
                model, experts = build(experts_implementation="grouped_mm"), "grouped_mm"
            except (ValueError, TypeError, ImportError):  # no grouped_mm experts here
                model, experts = build(), "eager"
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, cfg.vocab_size, (1, S), device=device)

        def step():
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        sync = lambda _: torch.cuda.synchronize() if device == "cuda" else None  # noqa: E731
        try:
            ms = median_ms(step, args.reps, sync)
        except RuntimeError as e:  # e.g. out of memory
            print(f"transformers S={S}: failed: {str(e)[:200]}", flush=True)
            continue
        emit({"impl": "transformers", "S": S, "ms": ms, "experts": experts,
              "params": sum(p.numel() for p in model.parameters())}, args.out)
        del model, opt


# ------------------------------------------------------------------------------------------------ driver

def run_worker(impl: str, args, S: int) -> list[dict]:
    """This script with --worker impl at S in a process of its own; its rows as they come."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--preset", args.preset, "--reps",
           str(args.reps), "--seq-lens", str(S), "--parts" if args.parts and S == args.seq_lens[0] else "--no-parts"]
    cmd += [a for kv in args.set for a in ("--set", kv)] + (["--out", args.out] if args.out else [])
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        for line in proc.stdout:
            if line.startswith(REPLY):
                rows.append(json.loads(line[len(REPLY):]))
                print(f"  {rows[-1]}", flush=True)
            else:
                print(line, end="", flush=True)
    if proc.returncode:
        print(f"{impl} worker exited with {proc.returncode}", flush=True)
    return rows


def tables(rows: list[dict]) -> str:
    ms = {(r["impl"], r["S"], r.get("mode")): r["ms"] for r in rows if "part" not in r}
    params = {r["impl"]: r["params"] for r in rows if "params" in r}
    out = [f"parameters: glmjax {params.get('glmjax', 0):,}, transformers {params.get('transformers', 0):,}", "",
           "| S | glmjax dense | glmjax sparse | transformers | dense / HF | sparse / HF |",
           "|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v: "-" if v is None else f"{v:,.0f} ms"  # noqa: E731
    for S in sorted({r["S"] for r in rows if "part" not in r}):
        d, s, h = ms.get(("glmjax", S, "dense")), ms.get(("glmjax", S, "sparse")), ms.get(("transformers", S, None))
        ratio = lambda g: "-" if not (g and h) else f"{h / g:.2f}x"  # noqa: E731
        out.append(f"| {S} | {fmt(d)} | {fmt(s)} | {fmt(h)} | {ratio(d)} | {ratio(s)} |")
    parts = [r for r in rows if "part" in r]
    if parts:
        out += ["", f"| part (S = {parts[0]['S']}) | ms per call | ms per step |", "|---|---:|---:|"]
        out += [f"| {r['part']} | {r['ms']:,.1f} | {r['per_step']:,.1f} |" for r in parts]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h200", help="a bench/gpu_throughput.py preset (h200, cpu)")
    ap.add_argument("--seq-lens", type=int, nargs="+")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a glmjax ModelConfig override, e.g. dense_attention_impl=xla or moe_impl=blocked")
    ap.add_argument("--parts", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", help="append every row here as a JSON line")
    ap.add_argument("--worker", choices=["glmjax", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from gpu_throughput import PRESETS
    if args.preset not in PRESETS:
        ap.error(f"--preset {args.preset!r}: one of {sorted(PRESETS)}")
    args.seq_lens = args.seq_lens or list(PRESETS[args.preset]["seq_lens"])
    if args.worker:
        (glmjax_worker if args.worker == "glmjax" else transformers_worker)(args)
        return 0
    rows = [r for S in args.seq_lens for impl in ("glmjax", "transformers") for r in run_worker(impl, args, S)]
    print("\n" + tables(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
