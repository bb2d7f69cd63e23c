"""Issue 41's diagnosis checks on the user's SFT -> RL path (bench/rl_tasks.py's arith task): the rendering of one
SFT pair in the SFT pipeline and in PPO's byte rule (token ids side by side), the PPO stage's starting parameters
against the SFT checkpoint's, greedy outputs of `generate` (glmjax-generate's path) against the PPO sampler's
step-0 greedy outputs, teacher-forced log-probs of the held-out answers, and the step-0 held-out evaluation.

    python bench/rl_sft_checks.py runs/arith [--sft-steps 900]    # trains the SFT stage first if needed

Numbers of 2026-12-06 are in docs/ppo.md "Diagnosis".
"""
import argparse
import copy
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import jax
import numpy as np
from flax import nnx
from rl_tasks import write_task, sft_config, ppo_config
from glmjax.launch import run
from glmjax.config import ModelConfig
from glmjax.data import make_pipeline
from glmjax.rl.ppo import PPORun, pack_samples
from glmjax.train.init_from import checkpoint_loader, init_model
from glmjax.model import GLM
from glmjax.infer import Decoder, generate
from glmjax.rl.text import ByteText, encode

ap = argparse.ArgumentParser()
ap.add_argument("workdir")
ap.add_argument("--sft-steps", type=int, default=None)
args = ap.parse_args()
root = args.workdir
paths = write_task("arith", os.path.join(root, "data"))
sft = os.path.join(root, "sft")
run(sft_config("arith", paths, args.sft_steps), sft, progress=False)
c = ppo_config("arith", paths, sft, "gae", 0)
c.ppo.async_rollout = False
r = PPORun(c, os.path.join(root, "probe"), checkpoint_loader(ModelConfig.from_dict(c.model)), progress=False)

# 1. rendering: SFT pipeline row vs PPO tokens of the same pair
sc = sft_config("arith", paths, args.sft_steps)
pipe = make_pipeline(sc.data, 128, 1, 0, split="train")
row = next(iter(pipe))
seg, tok, lm = row["segment_ids"][0], row["tokens"][0], row["loss_mask"][0]
first = seg == seg[0]
print("SFT row pos :", row["positions"][0][first].tolist())
print("SFT tokens  :", tok[first].tolist())
print("SFT lossmask:", lm[first].tolist())
txt = bytes(int(t) for t in tok[first] if t < 256).decode()
q, a = txt.split("=")[0] + "=", txt.split("=")[1]
print("pair:", q, a)
ppo_tokens = ByteText().prompt(type("P", (), {"prompt": q})()) + encode(a) + [257]
print("PPO tokens  :", ppo_tokens)

# 2. loaded policy == SFT checkpoint
from glmjax.train.checkpoint import load_model_state
st, meta, step = load_model_state(sft)
pol = nnx.to_pure_dict(r.learner.policy_state())
def flat(d, pre=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict): out.update(flat(v, pre + str(k) + "/"))
        else: out[pre + str(k)] = np.asarray(v)
    return out
fs, fp = flat(st), flat(pol)
common = sorted(set(fs) & set(fp))
diff = max(float(np.max(np.abs(fs[k].astype(np.float32) - fp[k].astype(np.float32)))) for k in common)
print(f"params: {len(common)} common leaves, max |SFT - PPO start| = {diff}; only in SFT: {len(set(fs)-set(fp))}, only in PPO: {len(set(fp)-set(fs))}")

# 3. greedy through generate (glmjax-generate's path, the SFT model config incl. MTP) vs PPO's greedy sampler
sft_model = GLM(ModelConfig.from_dict(meta["model"]), nnx.Rngs(0))
init_model(sft_model, sft)
probs = r.eval_problems
prompts = [r.text.prompt(p) for p in probs]
for mode in ("sparse", "dense"):
    g = generate(Decoder(sft_model, mode), prompts, 5, key=jax.random.key(0), stop_tokens=(257,), pad_id=r.text.pad_id)
    outs = [r.text.decode(g.tokens[b, :g.lengths[b]]) for b in range(len(probs))]
    acc = np.mean([o.strip() == p.row["answer"] for o, p in zip(outs, probs)])
    print(f"generate ({mode}) greedy held-out accuracy {acc:.3f}; first: {list(zip([p.prompt for p in probs[:6]], outs[:6]))}")
state = r.learner.policy_state()
smp = r.greedy.rollout(state, [r.make_clean_env(p, np.random.default_rng(0)) for p in probs[:r.B]], list(range(min(r.B, len(probs)))), -1, jax.random.key(0))
outs2 = [r.text.decode(s.response) for s in smp]
same = np.mean([o == o2 for o, o2 in zip(outs, outs2)])
print(f"PPO greedy sampler == generate (dense): {same:.3f}; acc {np.mean([s.reward for s in smp]):.3f}")
# teacher-forced on held-out: every answer token is argmax
samples = []
for p in probs[:r.B]:
    s = copy.copy(smp[0]); s.prompt = np.asarray(r.text.prompt(p), np.int32)
    s.response = np.asarray(encode(p.row["answer"]) + [257], np.int32); s.loss_mask = np.ones(len(s.response), np.float32)
    s.logprobs = np.zeros(len(s.response), np.float32); samples.append(s)
data = pack_samples(samples, r.B, r.L, r.text.pad_id)
from glmjax.rl.trainer import forward
lp = forward(r.learner.fns.logprobs, (r.learner.params, r.learner.rest), {k: data[k] for k in ("tokens","segment_ids","positions")}, 1, r.learner.placement)
m = data["mask"]
print("teacher-forced held-out: mean log-prob of answer tokens", float((lp*m).sum()/m.sum()), "; P(whole answer) mean", float(np.mean(np.exp((lp*m).sum(1)))))
print(r.evaluate())
