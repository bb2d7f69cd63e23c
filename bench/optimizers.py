"""AdamW vs Muon vs Muon-Split on the embedded stdlib corpus with configs/small.py (dense MLA attention).

    python bench/optimizers.py                       # lr sweep at reduced steps, then the full runs; writes the table
    python bench/optimizers.py --steps 20 --sweep-steps 0 --lrs 2e-3 --no-write    # smoke test
    python bench/optimizers.py --sweep-only --sweep-names muon_split --lrs 3e-2     # one more sweep point
    python bench/optimizers.py --timing-only                                        # optimizer update cost only

Every run starts from the same initial parameters and sees the same batches (same data order, same number of
tokens). Attention runs in "dense" mode: plain causal MLA, which is what Muon-Split is about and what reports the
largest attention logit per step (`max_attn_logit`); the lightning indexer is not used (and stays frozen, as in the
trainer). The train / eval steps are the trainer's own (`glmjax.train.step.make_train_step` / `make_eval_step`,
`glmjax.train.loop.evaluate`); only the optimizer changes.

Learning rates: every optimizer is built with peak lr 1 (`muon_lr = lr`, consistent-RMS Muon) and the scheduled lr
(linear warmup + cosine to 10%) multiplies the update from the optimizer state. That is exact -- AdamW's and Muon's
updates (decoupled weight decay included) are linear in lr -- and lets one compiled train step serve every lr of the
sweep. The sweep runs each lr for --sweep-steps steps of a schedule stretched to --sweep-steps (warmup 10%) and
keeps the lr with the lowest mean training loss over its last 10 steps.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import small  # noqa: E402
from glmjax.config import ModelConfig  # noqa: E402
from glmjax.data import make_pipeline  # noqa: E402
from glmjax.model.transformer import GLM  # noqa: E402
from glmjax.optim import build_optimizer  # noqa: E402
from glmjax.train.loop import evaluate, to_batch  # noqa: E402
from glmjax.train.step import make_eval_step, make_train_step, split_model  # noqa: E402

NAMES = ("adamw", "muon", "muon_split")


def scheduled(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """tx (built with peak lr 1, constant schedule) times lr(step) = peak * (linear warmup, cosine to end * peak);
    peak / warmup / total / end live in the state, so changing them does not recompile."""

    def init_fn(params):
        hp = {"peak": jnp.zeros((), jnp.float32), "warmup": jnp.zeros((), jnp.int32),
              "total": jnp.ones((), jnp.int32), "end": jnp.zeros((), jnp.float32)}
        return {"inner": tx.init(params), "count": jnp.zeros((), jnp.int32), "hp": hp}

    def update_fn(updates, state, params=None):
        u, inner = tx.update(updates, state["inner"], params)
        hp, t = state["hp"], state["count"].astype(jnp.float32)
        warm = hp["warmup"].astype(jnp.float32)
        frac = jnp.clip((t - warm) / jnp.maximum(hp["total"].astype(jnp.float32) - warm, 1.0), 0.0, 1.0)
        cosine = hp["end"] + (1.0 - hp["end"]) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        lr = hp["peak"] * jnp.where(t < warm, t / jnp.maximum(warm, 1.0), cosine)
        u = jax.tree.map(lambda x: (x * lr).astype(x.dtype), u)
        return u, {"inner": inner, "count": state["count"] + 1, "hp": hp}

    return optax.GradientTransformation(init_fn, update_fn)


def set_lr(state, peak, warmup, total, end):
    hp = {"peak": jnp.float32(peak), "warmup": jnp.int32(warmup), "total": jnp.int32(total), "end": jnp.float32(end)}
    return {**state, "hp": hp}


def opt_config(name: str, o) -> dict:
    """o: the config's optim section (weight decay, betas, clipping); the lr comes from `scheduled`."""
    return dict(name=name, lr=1.0, muon_lr=1.0, indexer_lr=1.0, schedule="constant", warmup_steps=0,
                total_steps=10 ** 9, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, grad_clip=o.grad_clip,
                split_rope="together", split_o_proj=False)


def copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def run(train_step, params0, rest0, tx, batches, peak, steps, warmup, end):
    params, rest = copy(params0), copy(rest0)
    opt_state = set_lr(jax.jit(tx.init)(params), peak, warmup, steps, end)
    out, times = [], []
    for step, b in enumerate(batches[:steps], 1):
        t0 = time.perf_counter()
        params, rest, opt_state, m = train_step(params, rest, opt_state, to_batch(b), step)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
        out.append(m)
    out = jax.device_get(out)
    return params, rest, {k: np.array([o[k] for o in out]) for k in ("loss", "lm_loss", "max_attn_logit")}, times


def time_updates(txs: dict, params, reps=7) -> dict:
    """Median seconds of one jitted optimizer update per optimizer (grads = constants of the parameters' shapes).
    All are compiled first, then timed round-robin, so a change of load on a shared machine hits all alike."""
    grads = jax.tree.map(lambda x: 1e-3 * jnp.ones_like(x), params)
    fns, states = {}, {}
    for name, tx in txs.items():
        fns[name] = jax.jit(tx.update)
        states[name] = jax.jit(tx.init)(params)
        jax.block_until_ready(fns[name](grads, states[name], params))
    ts = {name: [] for name in txs}
    for _ in range(reps):
        for name in txs:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](grads, states[name], params))
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in ts.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sweep-steps", type=int, default=12, help="0 skips the sweep (uses the first --lrs value)")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="peak lrs swept (all groups; Muon consistent-RMS)")
    ap.add_argument("--batch-size", type=int, default=4, help="0: configs/small.py train.batch_size (8)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: configs/small.py train.seq_len")
    ap.add_argument("--names", default=",".join(NAMES))
    ap.add_argument("--sweep-names", default="adamw,muon_split",
                    help="optimizers whose lr is swept; the others take the lr of --lr-from")
    ap.add_argument("--lr-from", default="muon=muon_split",
                    help="name=source pairs: unswept optimizers use the source's tuned lr (Muon and Muon-Split share "
                         "the consistent-RMS update scale)")
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--out", default="bench/results/optimizers.md")  # the table in docs/benchmarks.md came from here
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="only the lr sweep of --sweep-names (prints it)")
    ap.add_argument("--timing-only", action="store_true", help="only the round-robin optimizer-update timing")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    config = small.get_config()
    t = config.train
    cfg = ModelConfig.from_dict(config.model)
    B = args.batch_size or t.batch_size
    S = args.seq_len or t.seq_len
    lrs = [float(x) for x in args.lrs.split(",")]
    names = args.names.split(",")
    warmup = max(1, round(0.1 * args.steps))

    config.data.max_docs = args.max_docs
    data = make_pipeline(config.data, S, B, t.seed, "train")
    batches = data.take(max(args.steps, args.sweep_steps))
    eval_set = make_pipeline(config.data, S, B, t.seed, "eval").take(t.eval_batches)
    tokens = sum(int(np.sum(b["segment_ids"] > 0)) for b in batches[:args.steps])
    print(f"data: {data!r}; {args.steps} steps = {tokens:,} non-pad tokens; {len(eval_set)} eval batches",
          flush=True)

    model = GLM(cfg, nnx.Rngs(t.seed))
    graphdef, params0, rest0 = split_model(model)
    del model
    eval_step = make_eval_step(graphdef, "pretrain", "dense")

    if args.timing_only:
        txs = {n: scheduled(build_optimizer(params0, opt_config(n, config.optim), cfg)[0]) for n in names}
        sec = time_updates(txs, params0)
        print("| optimizer | optimizer update (ms, median of 7, round-robin) | vs AdamW |\n|---|---|---|")
        for n in names:
            print(f"| {n} | {sec[n] * 1e3:.1f} | {sec[n] / sec.get('adamw', sec[n]):.2f}x |")
        return
    if args.sweep_only:
        names = [n for n in names if n in args.sweep_names.split(",")]

    lr_from = dict(x.split("=") for x in args.lr_from.split(",") if x)
    inherits = [n for n in names if n not in args.sweep_names.split(",") and lr_from.get(n) in names]
    results, sweeps, tables, txs = {}, {}, {}, {}
    for name in [n for n in names if n not in inherits] + inherits:
        tx, table = build_optimizer(params0, opt_config(name, config.optim), cfg)
        tables[name] = table
        print(table, flush=True)
        tx = scheduled(tx)
        train_step = make_train_step(graphdef, tx, "pretrain", "dense", t.bias_update_rate)
        sweeps[name] = {}
        if name in inherits:
            best = results[lr_from[name]]["lr"]
        elif args.sweep_steps and (len(lrs) > 1 or args.sweep_only):
            for lr in lrs:
                sw_warm = max(1, round(0.1 * args.sweep_steps))
                _, _, m, _ = run(train_step, params0, rest0, tx, batches, lr, args.sweep_steps, sw_warm,
                                 t.end_lr_ratio)
                loss = float(np.mean(m["lm_loss"][-tail(args.sweep_steps):]))
                sweeps[name][lr] = loss if math.isfinite(loss) else float("inf")
                print(f"  sweep {name} lr={lr:g}: mean LM loss of the last {tail(args.sweep_steps)} of "
                      f"{args.sweep_steps} steps {loss:.4f} "
                      f"(max attn logit {np.max(m['max_attn_logit']):.1f})", flush=True)
            best = min(sweeps[name], key=sweeps[name].get)
        else:
            best = lrs[0]
        if args.sweep_only:
            continue
        params, rest, m, times = run(train_step, params0, rest0, tx, batches, best, args.steps, warmup,
                                     t.end_lr_ratio)
        ev = evaluate(eval_step, params, rest, eval_set)
        results[name] = dict(lr=best, train=float(np.mean(m["lm_loss"][-tail(args.steps):])), eval=ev["eval_loss"],
                             max_logit=float(np.max(m["max_attn_logit"])), final_logit=float(m["max_attn_logit"][-1]),
                             step_s=statistics.median(times[1:]) if len(times) > 1 else times[0],
                             curve=m["lm_loss"], logits=m["max_attn_logit"])
        r = results[name]
        print(f"{name}: lr {best:g}, train {r['train']:.4f}, eval {r['eval']:.4f}, max logit {r['max_logit']:.1f}, "
              f"step {r['step_s'] * 1e3:.0f} ms", flush=True)
        txs[name] = tx

    if args.sweep_only:
        return
    for name, sec in time_updates(txs, params0).items():
        results[name]["opt_s"] = sec
        print(f"{name}: optimizer update {sec * 1e3:.1f} ms (median, round-robin)", flush=True)

    results = {n: results[n] for n in names}
    wall = time.perf_counter() - t_start
    report = render(args, results, sweeps, tables, cfg, B, S, tokens, warmup, wall, data.source_name)
    print(report)
    if not args.no_write:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        print(f"wrote {args.out}")


def render(args, results, sweeps, tables, cfg, B, S, tokens, warmup, wall, source) -> str:
    base = results.get("adamw")
    cmd = "python bench/optimizers.py " + " ".join(sys.argv[1:])
    n_params = sum(r["params"] for r in next(iter(tables.values())).rows())
    lines = [
        "# Optimizer benchmark: AdamW vs Muon vs Muon-Split",
        "",
        f"- command: `{cmd.strip()}`",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; {platform.machine()} CPU, "
        f"{os.cpu_count()} cores (shared), jax {jax.__version__}, optax {optax.__version__}; wall {wall / 60:.1f} min",
        f"- model: configs/small.py ({n_params:,} trainable params; hidden {cfg.hidden_size}, "
        f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts), "
        "dense MLA attention (indexer unused, frozen)",
        f"- data: {source}; {B}x{S} tokens/step, {args.steps} steps, {tokens:,} non-pad tokens, identical batches "
        "and initial parameters for every optimizer"
        + (f" (configs/small.py trains {small.get_config().train.batch_size}x{small.get_config().train.seq_len} for "
           f"{small.get_config().train.steps} steps: reduced to fit ~15 min of a shared 2-core CPU)"
           if (B, S, args.steps) != (small.get_config().train.batch_size, small.get_config().train.seq_len,
                                     small.get_config().train.steps) else ""),
        f"- schedule: linear warmup {warmup} steps, cosine to 10% at step {args.steps}; weight decay 0.1 "
        "(decoupled, not on norms); grad clip 1.0; AdamW b1 0.9, b2 0.95; Muon momentum 0.95 Nesterov, 5 "
        "Newton-Schulz steps, consistent RMS 0.2 (muon_lr = lr)",
        "- Muon-Split: q_b_proj per head (rope with nope), kv_b_proj per head with W_UK / W_UV apart, o_proj whole",
        "",
    ]
    if any(sweeps.values()):
        lrs = sorted({lr for s in sweeps.values() for lr in s})
        swept = ", ".join(n for n in sweeps if sweeps[n])
        inherited = ", ".join(f"{n} uses the lr tuned for {src}" for n, src in
                              (x.split("=") for x in args.lr_from.split(",") if x) if n in results and not sweeps[n])
        lines += [f"lr sweep of {swept} ({args.sweep_steps} steps each, warmup {max(1, round(0.1 * args.sweep_steps))}"
                  f", cosine to 10% at step {args.sweep_steps}; mean LM loss of the last {tail(args.sweep_steps)} "
                  f"steps){'; ' + inherited if inherited else ''}:", "",
                  "| optimizer | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
                  "|---|" + "---|" * len(lrs)]
        for name, s in ((n, s) for n, s in sweeps.items() if s):
            lines.append(f"| {name} | " + " | ".join(f"{s[lr]:.4f}" if lr in s else "" for lr in lrs) + " |")
        lines.append("")
    lines += [f"Full runs ({args.steps} steps, tuned lr):", "",
              f"| optimizer | lr | train loss (last {tail(args.steps)}) | eval loss | max attn logit (run) "
              "| attn logit (last step) | train step (ms) | optimizer update (ms) | update vs AdamW |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rel = f"{r['opt_s'] / base['opt_s']:.2f}x" if base else "-"
        lines.append(f"| {name} | {r['lr']:g} | {r['train']:.4f} | {r['eval']:.4f} | {r['max_logit']:.2f} | "
                     f"{r['final_logit']:.2f} | {r['step_s'] * 1e3:.0f} | {r['opt_s'] * 1e3:.1f} | {rel} |")
    lines += ["", "Training loss (LM) every 10% of the run:", "",
              "| optimizer | " + " | ".join(f"step {i}" for i in checkpoints(args.steps)) + " |",
              "|---|" + "---|" * len(checkpoints(args.steps))]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['curve'][i - 1]:.3f}" for i in checkpoints(args.steps)) + " |")
    lines += ["", "Max attention logit every 10% of the run:", "",
              "| optimizer | " + " | ".join(f"step {i}" for i in checkpoints(args.steps)) + " |",
              "|---|" + "---|" * len(checkpoints(args.steps))]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['logits'][i - 1]:.1f}" for i in checkpoints(args.steps)) + " |")
    lines.append("")
    return "\n".join(lines) + "\n"


def tail(steps: int) -> int:
    """How many final steps the reported training loss averages over."""
    return max(1, min(10, steps // 4))


def checkpoints(steps: int) -> list[int]:
    return sorted({max(1, round(steps * k / 10)) for k in range(1, 11)})


if __name__ == "__main__":
    main()
