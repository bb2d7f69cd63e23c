"""What a PPO step changes, on the user's SFT -> RL path (bench/rl_tasks.py's arith task; issue 41):

  --steps N   runs N PPO steps (synchronous rollouts) from the SFT checkpoint and measures, at every step, the exact
              KL(pi_old || pi) over the whole vocabulary at each policy token of the step's batch (before the step's
              updates against after them) beside the sample estimate 1/2 (log pi - log pi_old)^2 on the sampled
              tokens, the fraction of those positions whose argmax changed, and the largest per-position KL
  --compare   greedy answers of the held-out problems under the SFT checkpoint and each given policy directory
              (a PPO workdir's policy/): which answers changed, right -> wrong and wrong -> right, accuracy by
              answer length

    python bench/rl_step_probe.py runs/arith --sft-steps 900 --steps 20 --lr 2e-5 [--method grpo] [--seed 0]
    python bench/rl_step_probe.py runs/arith --sft-steps 900 --compare runs/arith/probe_grpo_lr2e-05_seed0/policy

The SFT stage is trained first when runs/arith/sft<steps> has no checkpoint. Numbers of 2026-12-06 are in docs/ppo.md
("What the steps change" and "Which held-out answers change"); each step's record also goes to the run's
metrics.jsonl as x_* fields.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from rl_tasks import ppo_config, sft_config, write_task  # noqa: E402

from glmjax.config import ModelConfig  # noqa: E402
from glmjax.launch import run  # noqa: E402
from glmjax.rl import ppo  # noqa: E402
from glmjax.rl.trainer import as_batch  # noqa: E402
from glmjax.train.init_from import checkpoint_loader  # noqa: E402


def vocab_logprobs(fns):
    """-> jitted (params, rest, batch) -> log-softmax over the vocabulary [B, S, V] at the sampler's temperature."""
    @jax.jit
    def fn(params, rest, mb):
        model = nnx.merge(fns.actor_graphdef, params, rest)
        h, _ = model(as_batch(mb), fns.mode)
        logits = jnp.einsum("bsd,dv->bsv", h.astype(jnp.float32), model.lm_head[...].astype(jnp.float32))
        return jax.nn.log_softmax(logits / fns.temperature, axis=-1)
    return fn


def step_change(before: np.ndarray, after: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """before / after: [B, S, V] log-probs (position i predicts token i + 1); mask [B, S] on the policy tokens."""
    m = mask[:, 1:] > 0
    pb, pa, tok = before[:, :-1][m], after[:, :-1][m], tokens[:, 1:][m]
    exact = np.sum(np.exp(pb) * (pb - pa), axis=-1)
    rows = np.arange(len(tok))
    return {"exact_kl": float(exact.mean()), "exact_kl_max": float(exact.max()),
            "sample_estimate": float(np.mean(0.5 * (pa[rows, tok] - pb[rows, tok]) ** 2)),
            "argmax_changed": float(np.mean(pb.argmax(-1) != pa.argmax(-1)))}


def probe_steps(config, workdir: str) -> list[dict]:
    """Runs the PPO stage with Learner.update wrapped by the measurement -> one record per step."""
    records, update = [], ppo.Learner.update

    def measured(self, samples, version, rows, seq_len, train_actor):
        if not hasattr(self, "_vocab_logprobs"):
            self._vocab_logprobs = vocab_logprobs(self.fns)
        data = ppo.pack_samples(samples, rows, seq_len, self.pad_id)
        fwd = self.placement.shard({k: data[k] for k in ("tokens", "segment_ids", "positions")})
        before = np.asarray(self._vocab_logprobs(self.params, self.rest, fwd))
        m = update(self, samples, version, rows, seq_len, train_actor)
        after = np.asarray(self._vocab_logprobs(self.params, self.rest, fwd))
        rec = step_change(before, after, data["tokens"], data["mask"])
        records.append({"step": len(records) + 1, **rec})
        m.update({"x_" + k: v for k, v in rec.items()})
        return m

    ppo.Learner.update = measured
    try:
        run(config, workdir)
    finally:
        ppo.Learner.update = update
    return records


def greedy_answers(config, workdir: str) -> list[tuple[str, str, str, float]]:
    """(prompt, answer, greedy response, reward) for the held-out problems under config.ppo.init_checkpoint."""
    r = ppo.PPORun(config, workdir, checkpoint_loader(ModelConfig.from_dict(config.model)), False)
    state, out = r.learner.policy_state(), []
    for i in range(0, len(r.eval_problems), r.B):
        chunk = r.eval_problems[i:i + r.B]
        envs = [r.make_clean_env(pr, np.random.default_rng([0, i, j])) for j, pr in enumerate(chunk)]
        samples = r.greedy.rollout(state, envs, list(range(len(chunk))), -1, jax.random.key(i))
        out += [(pr.row["prompt"], pr.row["answer"], r.text.decode(s.response), s.reward)
                for pr, s in zip(chunk, samples)]
    return out


def compare(ref: list, new: list) -> dict:
    kinds, by_len = collections.Counter(), collections.defaultdict(list)
    for (q, a, r0, w0), (_, _, r1, w1) in zip(ref, new):
        by_len[len(a)].append((w0, w1))
        if r0 == r1:
            continue
        kind = "right->wrong" if w0 == 1 else "wrong->right" if w1 == 1 else "wrong->wrong"
        kinds[kind] += 1
        print(f"  {q:>10} {a:>4} | {r0!r:>7} -> {r1!r:<7} {kind}")
    return {"changed": dict(kinds), "accuracy": (float(np.mean([w for *_, w in ref])),
                                                 float(np.mean([w for *_, w in new]))),
            "by_answer_length": {n: (len(v), float(np.mean([x[0] for x in v])), float(np.mean([x[1] for x in v])))
                                 for n, v in sorted(by_len.items())}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", help="task directory (data/, sft<steps>/, probe runs)")
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4, help="the actor's lr (configs/ppo_tiny.py: 2e-4)")
    ap.add_argument("--method", default="grpo", choices=("grpo", "gae"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", nargs="+", default=None, metavar="POLICY_DIR")
    args = ap.parse_args()
    paths = write_task("arith", os.path.join(args.root, "data"))
    sft_cfg = sft_config("arith", paths, args.sft_steps)
    sft = os.path.join(args.root, f"sft{sft_cfg.train.steps}")
    run(sft_cfg, sft)
    if args.compare:
        def config(ckpt):
            c = ppo_config("arith", paths, ckpt, args.method, args.seed, steps=20)  # no step runs: any count
            c.ppo.eval_problems = 1000  # every held-out problem
            return c
        ref = greedy_answers(config(sft), os.path.join(args.root, "probe_eval"))
        for policy in args.compare:
            print(policy)
            print(json.dumps(compare(ref, greedy_answers(config(policy), os.path.join(args.root, "probe_eval")))))
        return
    c = ppo_config("arith", paths, sft, args.method, args.seed, args.steps)
    c.optim.lr, c.ppo.async_rollout, c.ppo.eval_every = args.lr, False, 5
    c.ppo.step_kl_per_nat = None  # a fixed lr: the steps that lr alone causes
    wd = os.path.join(args.root, f"probe_{args.method}_lr{args.lr:g}_seed{args.seed}")
    recs = probe_steps(c, wd)
    for r in recs:
        print(json.dumps(r))
    for k in ("exact_kl", "sample_estimate", "argmax_changed", "exact_kl_max"):
        print(f"median {k}: {np.median([r[k] for r in recs]):.4f}")
    evals = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
    print("held-out greedy:", [(e["step"], round(e["eval_accuracy"], 3)) for e in evals if "eval_accuracy" in e])


if __name__ == "__main__":
    main()
