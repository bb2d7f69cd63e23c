"""Speculative decoding with the shared MTP layer (docs/model.md D.4) against plain greedy decoding, on CPU:
acceptance length (generated tokens per verify pass), decode tokens/s and the extra memory, batch 1 and 8, d = 1..4.

    python bench/speculative.py [--workdir /tmp/spec_tiny] [--steps 1000] [--new-tokens 96] [--repeats 3]

The model is configs/tiny.py (6 layers, hidden 128, MTP depth 3, loss weight 0.1) trained by train.py for --steps
steps on the embedded stdlib corpus (kept in --workdir: a second run reuses it). Prompts are the first 32 tokens of
held-out rows (the corpus's eval split, which training never reads). Every configuration generates --new-tokens
tokens per row greedily (sparse attention, no stop token) after a warm-up call that compiles; decode tokens/s counts
the tokens after the first over the median wall time of --repeats calls minus that of a call generating one token
(the prefill, which yields the first; for speculative decoding it includes the MTP layer's pass over the prompt). Every
speculative run is checked token for token against plain greedy decoding. Extra memory: the MTP layer's cache and
the d extra verify slots of the main cache, and the compiled programs' temporaries (XLA's memory_analysis) of one
round against one plain decode step. Free generation from this small model soon repeats itself (runs of spaces,
"the the"), which the draft predicts easily, so the acceptance column also gives one round right after held-out
text (`first_round`: 32 eval rows cut at random lengths, prefilled, one round): the draft on real contexts.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def train(workdir: str, steps: int) -> float:
    """configs/tiny.py for `steps` steps into workdir (skipped when it finished before) -> wall seconds spent."""
    if os.path.exists(os.path.join(workdir, "summary.json")):
        return 0.0
    t0 = time.time()
    config = os.path.join(ROOT, "configs", "tiny.py")
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--config={config}",
                    f"--workdir={workdir}", f"--config.train.steps={steps}", "--config.train.eval_every=0"],
                   check=True, cwd=ROOT)
    return time.time() - t0


def prompts(n: int, length: int = 32) -> list[list[int]]:
    from configs import tiny
    from glmjax.data.pipeline import make_pipeline

    cfg = tiny.get_config()
    batch = next(iter(make_pipeline(cfg.data, 128, 8, seed=0, split="eval")))
    rows = [row[:length].tolist() for row in batch["tokens"]]
    return (rows * -(-n // len(rows)))[:n]


def first_round(dec, d: int, rows: int = 32, seed: int = 0) -> float:
    """Mean tokens of one round (acc + 1) right after held-out text: `rows` eval rows cut at random lengths 16..120,
    prefilled, then one draft-verify round. Free generation from a small model soon repeats itself, which drafts
    predict easily; this measures the draft against the main model on real contexts."""
    import jax.numpy as jnp

    from configs import tiny
    from glmjax.data.pipeline import make_pipeline
    from glmjax.infer.generate import speculator

    it = iter(make_pipeline(tiny.get_config().data, 128, 8, seed=0, split="eval", num_epochs=None))
    text = np.concatenate([next(it)["tokens"] for _ in range(-(-rows // 8))])[:rows]
    lengths = np.random.default_rng(seed).integers(16, 121, rows).astype(np.int32)
    spec = speculator(dec, d)
    caches, mtp = spec.init_cache(rows, 128 + d + 1)
    _, _, r, caches, mtp = spec.prefill(dec.state, jnp.asarray(text[:, :120]), jnp.asarray(lengths), caches, mtp)
    acc = spec.round(dec.state, r, caches, mtp)[2]
    return float(np.mean(np.asarray(acc) + 1))


def cache_bytes(tree) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def temp_bytes(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/glmjax_spec_tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    train_s = train(args.workdir, args.steps)

    import jax
    import jax.numpy as jnp

    from glmjax.infer import Decoder, generate
    from glmjax.infer.generate import prompt_batch, speculator
    from glmjax.resolve import load_model

    model, loaded = load_model(args.workdir)
    dec = Decoder(model, "sparse")
    load0 = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
    wall0 = time.time()
    rows = []
    for B in args.batches:
        ps = prompts(B)
        runs = {}
        for d in [0] + args.depths:
            def timed(n):  # -> (Generation, median wall s) of n new tokens per row, after a compiling call
                generate(dec, ps, n, key=jax.random.key(0), speculative=d)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = generate(dec, ps, n, key=jax.random.key(0), speculative=d)
                    times.append(time.perf_counter() - t0)
                return out, statistics.median(times)

            out, s = timed(args.new_tokens)
            runs[d] = (out, s - timed(1)[1])  # the decode part: minus the prefill (which yields the first token)
        plain, plain_s = runs[0]
        tokens, lengths, T = prompt_batch(dec, ps, args.new_tokens, 0, None)
        decode_temp = temp_bytes(dec.decode, dec.state, jnp.zeros((B,), jnp.int32), jnp.asarray(lengths),
                                 dec.init_cache(B, T))
        main_cache = cache_bytes(dec.init_cache(B, T))
        for d, (out, s) in runs.items():
            assert np.array_equal(out.tokens, plain.tokens), f"batch {B}, d={d}: speculative != plain greedy"
            per_verify = float(np.sum(out.lengths - 1) / np.sum(out.steps))
            extra = "-"
            if d:
                spec = speculator(dec, d)
                _, _, T_d = prompt_batch(dec, ps, args.new_tokens, 0, None, extra=d)
                caches, mtp = spec.init_cache(B, T_d)
                r = spec.prefill(dec.state, jnp.asarray(tokens), jnp.asarray(lengths), *spec.init_cache(B, T_d))[2]
                round_temp = temp_bytes(spec.round, dec.state, r, caches, mtp)
                extra = (f"caches +{(cache_bytes(caches) + cache_bytes(mtp) - main_cache) / 2 ** 10:.0f} KiB "
                         f"(of {main_cache / 2 ** 10:.0f}); temporaries {round_temp / 2 ** 10:.0f} vs "
                         f"{decode_temp / 2 ** 10:.0f} KiB")
            tok_s = B * (args.new_tokens - 1) / s
            real = f"{first_round(dec, d):.2f}" if d and B == args.batches[0] else ""
            rows.append((B, d, per_verify, real, tok_s, plain_s / s, extra))
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime - cpu0
    print(f"model: configs/tiny.py {loaded.where} in {args.workdir} ({train_s:.0f} s of training this run); "
          f"{args.new_tokens} new tokens per row, sparse attention, greedy; median of {args.repeats}")
    print(f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after; measuring: {time.time() - wall0:.0f} s "
          f"wall, {cpu:.0f} s CPU")
    print("| batch | d | tokens per verify | first round after held-out text | decode tokens/s | vs plain "
          "| extra memory |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for B, d, pv, real, ts, ratio, extra in rows:
        print(f"| {B} | {d or 'plain'} | {pv:.2f} | {real} | {ts:,.0f} | {ratio:.2f}x | {extra} |")


if __name__ == "__main__":
    main()
