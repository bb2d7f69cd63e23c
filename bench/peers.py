"""glmjax against Hugging Face transformers (torch CPU, eager attention) on one random `glm_moe_dsa` checkpoint.

    python bench/peers.py [--seq-lens 1024 2048 4096 8192] [--train-seq-lens 1024 2048 4096] [--reps 5]

A random GlmMoeDsaForCausalLM (D 192, 4 layers, 12 routed experts + 1 shared, indexer top-k 64, float32) is written
with `save_pretrained`; glmjax imports it with `glmjax.interop.load_hf`. Each implementation runs in its own worker
process (this script with --worker) and the main process sends them one timed call at a time, alternating which
goes first, so both see the same machine load. Before timing, the logits of one S = --check-len sequence are
compared: once as each computes them, and once with transformers forced to glmjax's top-k (exact ties -- a key
scoring exactly 0 when all of a query's indexer ReLUs clip -- are broken differently by torch.topk and lax.top_k).

  prefill:    one sequence of S tokens -> cache + last-token logits (glmjax: `Decoder.prefill`, sparse mode;
              transformers: model(ids, use_cache=True, logits_to_keep=1) under no_grad)
  train step: LM loss, backward, AdamW (glmjax: the trainer's step, stage pretrain, sparse attention; transformers:
              model(ids, labels=ids).loss.backward(), torch.optim.AdamW.step())

Reported: median wall seconds per call over --reps rounds (first call of each shape excluded: compile / warm-up)
and the ratio transformers / glmjax; the same for the CPU seconds each worker process spent on the call (all its
threads: steadier than wall time on a shared machine, but it also counts threads that spin while waiting); the
1-minute load average before the run and after each round.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_CONFIG = dict(
    vocab_size=1024, hidden_size=192, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=12, n_shared_experts=1,
    num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=4, index_head_dim=32, index_topk=64, indexer_types=["full"] * 4,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, max_position_embeddings=8192,
    rms_norm_eps=1e-5, num_nextn_predict_layers=0, tie_word_embeddings=False, attention_bias=False)
REPLY = "@@"  # worker replies start with this; anything else a library prints is ignored


# ------------------------------------------------------------------------------------------------ checkpoint


def write_checkpoint(path: str, seed: int = 0) -> None:
    """Random transformers model (unit-scale weights, so logits are O(1)) -> save_pretrained(path)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GlmMoeDsaConfig(**HF_CONFIG)
    model = transformers.GlmMoeDsaForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)


def timed(fn) -> list[float]:
    """-> [wall seconds, CPU seconds of this process (all threads)] of fn()."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    fn()
    return [time.perf_counter() - t0, time.process_time() - cpu0]


def tokens(S: int):
    import numpy as np

    return np.random.default_rng(S).integers(0, HF_CONFIG["vocab_size"], (1, S)).astype(np.int32)


# ---------------------------------------------------------------------------------------------------- workers


class GlmjaxWorker:
    def __init__(self, ckpt: str):
        import jax
        from flax import nnx

        from bench.stages import device_state
        from glmjax.infer import Decoder
        from glmjax.interop import load_hf
        from glmjax.optim.config import default_optim_config
        from glmjax.train.step import make_optimizer, make_train_step, split_model

        self.jax, self.ckpt = jax, ckpt
        model, _ = load_hf(ckpt)
        self.decoder = Decoder(model, "sparse")
        graphdef, params, rest = split_model(model, "model")
        params, rest = jax.tree.map(lambda a: a.copy(), (params, rest))  # the step donates them; prefill keeps its own
        optim = default_optim_config(name="adamw", lr=1e-4, schedule="constant", warmup_steps=0)
        self.tx, _ = make_optimizer(params, optim, 1000, model.cfg)
        self.state = device_state(params, rest, self.tx)  # else step 2 compiles again (see device_state)
        self.step_fn = make_train_step(graphdef, self.tx, "pretrain", "sparse", 1e-3)
        self.step = 0
        self.nnx = nnx

    def batch(self, S):
        import jax.numpy as jnp

        from glmjax.model import Batch

        return Batch(jnp.asarray(tokens(S)), jnp.ones((1, S), jnp.int32), jnp.arange(S, dtype=jnp.int32)[None])

    def prefill(self, S):
        import jax.numpy as jnp

        tok, lengths = jnp.asarray(tokens(S)), jnp.full((1,), S, jnp.int32)
        caches = self.decoder.init_cache(1, S)
        self.jax.block_until_ready(caches)
        return timed(lambda: self.decoder.prefill(self.decoder.state, tok, lengths, caches)[0].block_until_ready())

    def train(self, S):
        import jax.numpy as jnp

        batch = self.batch(S)
        self.step += 1

        def step():
            *self.state, m = self.step_fn(*self.state, batch, jnp.int32(self.step))
            m["loss"].block_until_ready()

        return timed(step)

    def check(self, S, out):
        """Logits [1,S,V] and the top-k each layer used -> out (npz)."""
        import numpy as np

        from glmjax.interop import load_hf
        from glmjax.model.backends import XLA

        model, _ = load_hf(self.ckpt, overrides={"scan_layers": False})  # unrolled: each layer's top-k comes out
        used = []

        def rec_topk(*a, **kw):
            ids, vals = XLA.index_topk(*a, **kw)
            used.append(ids)
            return ids, vals

        @self.nnx.jit
        def run(m, b):
            used.clear()
            h, _ = m(b, "sparse", backend=XLA._replace(index_topk=rec_topk))
            return m.logits(h), list(used)

        logits, ids = run(model, self.batch(S))
        np.savez(out, logits=np.asarray(logits), topk=np.stack([np.asarray(i) for i in ids]))
        return 0.0


class TransformersWorker:
    def __init__(self, ckpt: str):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, attn_implementation="eager").float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def prefill(self, S):
        ids = self.torch.tensor(tokens(S), dtype=self.torch.long)
        self.model.eval()

        def run():
            with self.torch.no_grad():
                self.model(ids, use_cache=True, logits_to_keep=1)

        return timed(run)

    def train(self, S):
        ids = self.torch.tensor(tokens(S), dtype=self.torch.long)
        self.model.train()

        def step():
            self.model(ids, labels=ids).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

        return timed(step)

    def check(self, S, ref):
        """-> max |logit difference| against glmjax's (ref npz) with transformers' own top-k and with glmjax's,
        and the fraction of (layer, query) rows whose selected key sets differ."""
        import numpy as np

        torch, model = self.torch, self.model
        model.eval()
        theirs = np.load(ref)
        forced = torch.tensor(theirs["topk"], dtype=torch.long)  # [L,1,S,k], -1 = no key
        own = torch.arange(S)[None, :, None].expand_as(forced[0])  # -1 -> the query itself (already selected)
        forced = torch.where(forced < 0, own, forced)
        ids = torch.tensor(tokens(S), dtype=torch.long)
        seen = []
        layers = [lyr.self_attn.indexer for lyr in model.model.layers]

        def run(force):
            hooks = [ix.register_forward_hook(lambda m, i, o, n=n: forced[n].to(o.dtype) if force else seen.append(o))
                     for n, ix in enumerate(layers)]
            with torch.no_grad():
                logits = model(ids, use_cache=False).logits.numpy()
            for h in hooks:
                h.remove()
            return float(np.max(np.abs(logits - theirs["logits"])))

        free, pinned = run(False), run(True)
        differ = sum(set(a[a >= 0].tolist()) != {x for x in b.tolist() if x <= t}
                     for a_l, b_l in zip(theirs["topk"][:, 0], (s[0].numpy() for s in seen))
                     for t, (a, b) in enumerate(zip(a_l, b_l)))
        return {"own_topk": free, "forced_topk": pinned, "rows_differ": differ / (len(layers) * S)}


def worker(impl: str, ckpt: str) -> int:
    w = (GlmjaxWorker if impl == "glmjax" else TransformersWorker)(ckpt)
    print(REPLY + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        result = getattr(w, cmd["op"])(*cmd["args"])
        print(REPLY + json.dumps(result), flush=True)
    return 0


class Peer:
    def __init__(self, impl: str, ckpt: str):
        self.impl = impl
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", impl, "--ckpt", ckpt],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.read()

    def read(self):
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"{self.impl} worker exited with {self.proc.wait()}")

    def call(self, op, *args):
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        return self.read()


# ------------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--train-seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-len", type=int, default=1024)
    ap.add_argument("--workdir", default="/tmp/glmjax_peers")
    ap.add_argument("--out", default="bench/results/peers.json")
    ap.add_argument("--worker", choices=["glmjax", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.ckpt)
    ckpt = os.path.join(args.workdir, "glm_moe_dsa_tiny")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        write_checkpoint(ckpt)
    load0 = os.getloadavg()[0]
    peers = {impl: Peer(impl, ckpt) for impl in ("glmjax", "transformers")}
    ref = os.path.join(args.workdir, "glmjax_check.npz")
    peers["glmjax"].call("check", args.check_len, ref)
    agree = peers["transformers"].call("check", args.check_len, ref)
    print(f"logits at S={args.check_len}: max |diff| {agree['own_topk']:.2e} with each one's top-k "
          f"({agree['rows_differ']:.1%} of layer-query rows select different keys), "
          f"{agree['forced_topk']:.2e} with transformers forced to glmjax's top-k", flush=True)
    if not agree["forced_topk"] < 1e-3:
        raise SystemExit("logits disagree: not timing")
    runs = [("prefill", S) for S in args.seq_lens] + [("train", S) for S in args.train_seq_lens]
    times = {(impl, op, S): [] for impl in peers for op, S in runs}
    loads = []
    for rep in range(args.reps + 1):  # round 0: compile / warm-up
        for op, S in runs:
            for impl in (list(peers) if rep % 2 else list(peers)[::-1]):
                wall_cpu = peers[impl].call(op, S)
                if rep:
                    times[impl, op, S].append(wall_cpu)
        loads.append(os.getloadavg()[0])
        print(f"round {rep}/{args.reps} done, load {loads[-1]:.2f}", flush=True)
    lines = [f"S = {args.check_len} logits: max |diff| {agree['forced_topk']:.1e} (transformers forced to glmjax's "
             f"top-k), {agree['own_topk']:.1e} with each one's own top-k ({agree['rows_differ']:.1%} of layer-query "
             f"rows select different keys); load average (1 min) {load0:.2f} before, {min(loads):.2f}-"
             f"{max(loads):.2f} after each round; medians of {args.reps} interleaved rounds", "",
             "| | S | transformers (s) | glmjax (s) | transformers / glmjax | CPU s: transformers | glmjax | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    results = {"agreement": agree, "load_before": load0, "loads": loads, "reps": args.reps, "runs": {}}
    for op, S in runs:
        (hf, hf_cpu), (ours, ours_cpu) = ([statistics.median(x) for x in zip(*times[impl, op, S])]
                                          for impl in ("transformers", "glmjax"))
        results["runs"][f"{op}/{S}"] = {"transformers_s": hf, "glmjax_s": ours, "ratio": hf / ours,
                                        "transformers_cpu_s": hf_cpu, "glmjax_cpu_s": ours_cpu}
        lines.append(f"| {'train step' if op == 'train' else op} | {S} | {hf:.3f} | {ours:.3f} | {hf / ours:.2f}x | "
                     f"{hf_cpu:.2f} | {ours_cpu:.2f} | {hf_cpu / ours_cpu:.2f}x |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
