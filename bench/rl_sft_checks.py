"""Issue 41's diagnosis checks on the user's SFT -> RL path (bench/rl_tasks.py's arith task): the rendering of one
SFT pair in the SFT pipeline and in PPO's byte rule (token ids side by side), the PPO stage's starting parameters
against the SFT checkpoint's, greedy outputs of `generate` (glmjax-generate's path) against the PPO sampler's
step-0 greedy outputs, teacher-forced log-probs of the held-out answers, and the step-0 held-out evaluation.

    python bench/rl_sft_checks.py runs/arith [--sft-steps 900]    # trains the SFT stage first if needed

Numbers of 2026-12-06 are in docs/ppo.md "Diagnosis".
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from rl_tasks import ppo_config, sft_config, write_task  # noqa: E402

from glmjax.config import ModelConfig  # noqa: E402
from glmjax.data import make_pipeline  # noqa: E402
from glmjax.infer import Decoder, generate  # noqa: E402
from glmjax.launch import run  # noqa: E402
from glmjax.model import GLM  # noqa: E402
from glmjax.rl.ppo import PPORun, pack_samples  # noqa: E402
from glmjax.rl.rollout import Sample  # noqa: E402
from glmjax.rl.tasks import Problem  # noqa: E402
from glmjax.rl.trainer import forward  # noqa: E402
from glmjax.train.checkpoint import load_model_state  # noqa: E402
from glmjax.train.init_from import checkpoint_loader, init_model  # noqa: E402


def rendering(sft_data, text):
    """The first pair of the SFT pipeline's first row, and the same pair as PPO's text rule renders it."""
    row = next(iter(make_pipeline(sft_data, 128, 1, 0, split="train")))
    first = row["segment_ids"][0] == row["segment_ids"][0][0]
    tokens = row["tokens"][0][first]
    print("SFT positions:", row["positions"][0][first].tolist())
    print("SFT tokens   :", tokens.tolist())
    print("SFT loss mask:", row["loss_mask"][0][first].tolist())
    question, answer = text.decode(tokens).split("=")
    print("PPO tokens   :", text.prompt(Problem(question + "=", answer)) + text.encode(answer) + [text.eos_id])


def flat(tree, prefix="") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + str(k): np.asarray(v, np.float32)})
    return out


def loaded_policy(sft: str, r: PPORun) -> dict:
    """Max abs difference of the PPO stage's starting parameters from the SFT checkpoint's. -> the SFT meta."""
    state, meta, _ = load_model_state(sft)
    a, b = flat(state), flat(nnx.to_pure_dict(r.learner.policy_state()))
    common = sorted(set(a) & set(b))
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in common)
    print(f"params: {len(common)} common tensors, max |SFT - PPO start| = {diff}; only in SFT: {len(set(a) - set(b))},"
          f" only in PPO: {len(set(b) - set(a))}")
    return meta


def greedy(sft: str, meta: dict, r: PPORun) -> list:
    """Held-out greedy outputs of `generate` on the SFT model (glmjax-generate's path, MTP layer included) in both
    attention modes, against the PPO stage's greedy sampler at step 0."""
    model = GLM(ModelConfig.from_dict(meta["model"]), nnx.Rngs(0))
    init_model(model, sft)
    problems = r.eval_problems
    prompts = [r.text.prompt(p) for p in problems]
    for mode in ("sparse", "dense"):
        g = generate(Decoder(model, mode), prompts, r.p.max_response_len, key=jax.random.key(0),
                     stop_tokens=(r.text.eos_id,), pad_id=r.text.pad_id)
        outs = [r.text.decode(g.tokens[b, :g.lengths[b]]) for b in range(len(problems))]
        acc = np.mean([o.strip() == p.row["answer"] for o, p in zip(outs, problems)])
        print(f"generate ({mode}): held-out greedy accuracy {acc:.3f}; first: "
              f"{list(zip([p.prompt for p in problems[:6]], outs[:6]))}")
    n = min(r.B, len(problems))
    envs = [r.make_clean_env(p, np.random.default_rng(0)) for p in problems[:n]]
    samples = r.greedy.rollout(r.learner.policy_state(), envs, list(range(n)), -1, jax.random.key(0))
    same = np.mean([o == r.text.decode(s.response) for o, s in zip(outs, samples)])
    print(f"PPO greedy sampler == generate on the first {n}: {same:.3f}")
    return problems[:n]


def teacher_forced(problems: list, r: PPORun):
    """The trainer's log-probs of the held-out answers (EOS included), as PPO packs a sample."""
    samples = []
    for p in problems:
        response = np.asarray(r.text.encode(p.row["answer"]) + [r.text.eos_id], np.int32)
        samples.append(Sample(np.asarray(r.text.prompt(p), np.int32), response, np.ones(len(response), np.float32),
                              np.zeros(len(response), np.float32), 0, "ok", 0, 0.0, {}))
    data = pack_samples(samples, r.B, r.L, r.text.pad_id)
    fwd = {k: data[k] for k in ("tokens", "segment_ids", "positions")}
    lp = forward(r.learner.fns.logprobs, (r.learner.params, r.learner.rest), fwd, 1, r.learner.placement) * data["mask"]
    print(f"teacher-forced held-out: mean log-prob of an answer token {lp.sum() / data['mask'].sum():.3f}, "
          f"mean P(whole answer) {np.mean(np.exp(lp.sum(1)[:len(problems)])):.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--sft-steps", type=int, default=None, help="default: bench/rl_tasks.py's")
    args = ap.parse_args()
    paths = write_task("arith", os.path.join(args.workdir, "data"))
    sft = os.path.join(args.workdir, "sft")
    sft_cfg = sft_config("arith", paths, args.sft_steps)
    run(sft_cfg, sft, progress=False)
    c = ppo_config("arith", paths, sft, "gae", 0)
    c.ppo.async_rollout = False
    r = PPORun(c, os.path.join(args.workdir, "probe"), checkpoint_loader(ModelConfig.from_dict(c.model)), False)
    rendering(sft_cfg.data, r.text)
    meta = loaded_policy(sft, r)
    teacher_forced(greedy(sft, meta, r), r)
    print("step-0 evaluation:", r.evaluate())


if __name__ == "__main__":
    main()
