"""End-to-end PPO on CPU (slow, but for the options run): a tiny GLM (2 layers: MLA + DSA sparse attention + MoE +
IndexShare) is briefly supervised on a task with its own LM loss, handed to `train_ppo` through the `load_params`
hook (the path a checkpoint loader takes), and trained with critic PPO and asynchronous rollouts."""
import json
import os
import shutil
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from glmjax.infer import Decoder
from glmjax.model import GLM
from glmjax.optim.config import default_optim_config
from glmjax.rl import default_ppo_config, train_ppo, validate_ppo_config
from glmjax.rl.env import SingleTurnEnv, ToolEnv, answer_directly, decode, read_answer_file, run_script, use_calculator
from glmjax.rl.interceptor import Interceptor
from glmjax.rl.ppo import build_task
from glmjax.rl.rollout import Sampler
from glmjax.rl.tasks import exact_reward
from glmjax.rl.warmup import supervised_warmup
from helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.fault_injection import SMALL_PPO_MODEL  # noqa: E402
from configs import ppo_tiny  # noqa: E402

MODEL = {**TINY, **SMALL_PPO_MODEL, "num_nextn_predict_layers": 0, "block_q": 256, "loss_chunk": 512}


def make_config(model=None, **ppo):
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict({**MODEL, **(model or {})})
    c.optim = default_optim_config(name="adamw", lr=3e-4, warmup_steps=10, weight_decay=0.0)
    c.ppo = default_ppo_config(**{"init_checkpoint": "in-memory warm-up", **ppo})
    return c


def warm_start(c, episode, steps, batch_size, seq_len, seed=0):
    """The test's own supervised warm-up, then the state handed over like a loaded checkpoint.
    -> (model, loader, warm-up losses)."""
    model = GLM(validate_ppo_config(c), nnx.Rngs(seed))
    losses = supervised_warmup(model, episode, steps, batch_size, seq_len, c.optim.to_dict(), 3e-3, c.ppo.mode,
                               258, seed)
    assert losses[-1] < 0.5 * losses[0]
    state = nnx.state(model)
    return model, (lambda path, target: state), losses


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------- PPO learns, for any seed

# The suite runs seed 2 in the one-thread float stream; the in-process runs are for docs/ppo.md's table
# (GLMJAX_E2E_SEEDS=0,1,2 runs those seeds in both streams: six runs). The suite's second PPO run is the README's
# demo at 2 layers and 8 experts (test_documented_demo_learns: another seed, train.py's built-in warm-up, 100 steps,
# the same task), which also carries this test's checks of the critic, the log-prob alignment and the asynchronous
# lag.
SEEDS = tuple(int(s) for s in os.environ.get("GLMJAX_E2E_SEEDS", "").split(",") if s)
ACTOR_LR = 2e-4
LEARNING = dict(task_args={"low": 0, "high": 9, "ops": "+", "max_result": 9}, heldout_fraction=0.3, steps=100,
                prompts_per_step=16, group_size=4, max_prompt_len=6, max_response_len=4, ppo_epochs=2,
                minibatches=2, critic_optim={"lr": 1e-3}, critic_warmup_steps=10, eval_every=50, eval_samples=16,
                async_rollout=True, checkpoint_every=100)  # one checkpoint, at the end (none is resumed here)
# Stated margins (absolute): held-out solve rate of 16 sampled answers per problem (+0.10), held-out greedy
# accuracy (+0.05: at least one more of the 17 held-out problems), training reward (mean of the last 20 steps vs
# steps 1-10, the critic's warm-up: +0.15), critic explained variance over the last 20 steps (> 0: better than
# predicting the mean return).
MARGINS = dict(sampled=0.10, greedy=0.05, reward=0.15, explained_variance=0.0)


def learning_run(seed: int, workdir: str) -> dict:
    """Single-digit sums (a + b <= 9), 30% of the problems held out; 60 supervised warm-up steps, then 100 PPO
    steps. -> the numbers the margins are about, plus the warm-up losses (a fingerprint of the float stream)."""
    c = make_config(seed=seed, **LEARNING)
    c.optim.lr = ACTOR_LR
    task = build_task(c.ppo)

    def episode(rng):
        p = task.sample(rng)
        return run_script(SingleTurnEnv(p, exact_reward), answer_directly(p))

    _, load, sft = warm_start(c, episode, 60, 64, 10, seed)
    s = train_ppo(c, workdir, progress=False, load_params=load)
    rows = [r for r in metrics(workdir) if "reward_mean" in r]
    mean = lambda key, rr: float(np.nanmean([r[key] for r in rr if r.get(key) is not None]))  # noqa: E731
    return {"seed": seed, "sft_losses": sft,
            "sampled": (s["eval_sampled_accuracy_start"], s["eval_sampled_accuracy"]),
            "greedy": (s["eval_accuracy_start"], s["eval_accuracy"]),
            "reward": (mean("reward_mean", rows[:10]), mean("reward_mean", rows[-20:])),
            "explained_variance": mean("explained_variance", rows[-20:]),
            "logp_mismatch": max([r["logp_mismatch"] for r in rows if "logp_mismatch" in r], default=None),
            "final_version": s["final_version"], "max_staleness": max(r["staleness"] for r in rows),
            "max_truncated": max(r["truncated"] for r in rows)}


def check_learning(r: dict):
    assert r["sampled"][1] >= r["sampled"][0] + MARGINS["sampled"], r
    assert r["greedy"][1] >= r["greedy"][0] + MARGINS["greedy"], r
    assert r["reward"][1] >= r["reward"][0] + MARGINS["reward"], r
    assert r["explained_variance"] > MARGINS["explained_variance"], r


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_raises_heldout_accuracy_and_the_critic_learns(seed, tmp_path):
    """Every seed improves by the stated margins (held-out accuracy sampled and greedy, training reward) with a
    critic that explains part of the return's variance."""
    r = learning_run(seed, str(tmp_path))
    print(r)
    check_learning(r)
    # token in / token out: at the weights that sampled them (critic warm-up: the version stays 0) the trainer
    # reproduces the sampler's log-probs
    assert r["logp_mismatch"] is not None and r["logp_mismatch"] < 1e-3
    assert r["final_version"] == 100 - 10 and r["max_staleness"] <= 1  # async: one step of lag


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ppo_learns_with_another_float_stream(tmp_path):
    """The same run with XLA on one CPU thread and one device (taskset -c 0, Eigen's thread pool off) in a
    subprocess: a different float stream (its warm-up losses differ from this process's for the same seed), the
    same margins. Seed 2 here (the demo test is the suite's other PPO run, within its time budget);
    GLMJAX_E2E_SEEDS=0,1,2 runs the three seeds of docs/ppo.md's table in both streams."""
    seeds = tuple(int(s) for s in os.environ.get("GLMJAX_E2E_SEEDS", "2").split(","))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false",
           "JAX_PLATFORMS": "cpu",  # this checkout's glmjax, installed or not
           "PYTHONPATH": os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    out = tmp_path / "runs.json"
    cmd = [sys.executable, os.path.abspath(__file__), str(out), str(tmp_path), *map(str, seeds)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0"] + cmd
    subprocess.run(cmd, env=env, check=True, timeout=1100)
    runs = json.loads(out.read_text())
    assert [r["seed"] for r in runs] == list(seeds)
    for r in runs:
        print(r)
        check_learning(r)
    c = make_config(seed=seeds[0], **LEARNING)
    task = build_task(c.ppo)
    here = supervised_warmup(GLM(validate_ppo_config(c), nnx.Rngs(seeds[0])), lambda rng: (lambda p: run_script(
        SingleTurnEnv(p, exact_reward), answer_directly(p)))(task.sample(rng)), 60, 64, 10, c.optim.to_dict(), 3e-3,
        c.ppo.mode, 258, seeds[0])
    assert here != runs[0]["sft_losses"]  # really another float stream (not bitwise the in-process one)


DEMO_STEPS = 100  # the README demo's 150 PPO steps, shortened (margins measured at both)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_documented_demo_learns(tmp_path):
    """The README's `python train.py --config=configs/ppo_tiny.py --workdir=...`, as a user runs it (a process of its
    own with XLA's default compiler: this run is bound by running, not compiling), with the model at 2 layers and 8
    experts and 100 PPO steps instead of 150 (35 s from the compilation cache, against 255 s for the
    README's 6-layer model at 150): after its built-in supervised warm-up it raises the held-out sampled solve rate
    by >= 0.10 and the training reward by >= 0.15, held-out greedy accuracy within one of its 17 problems (the
    README's statement), with a critic that explains part of the return's variance; the trainer reproduces the
    sampler's log-probs, and the asynchronous rollouts lag by at most one version. Measured so (2026-12-07,
    ppo.seed 0 and 1): sampled 0.250 -> 0.415 and 0.261 -> 0.408, greedy 0.353 -> 0.471 both, reward 0.56 -> 0.86
    and 0.57 -> 0.84, explained variance 0.34 and 0.11 (at 150 steps: sampled +0.21 and +0.18). The 6-layer demo's
    curves over 3 seeds: bench/ppo_curves.py, docs/ppo.md."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the compilation cache: $GLMJAX_CACHE_DIR
    model = [f"--config.model.{k}={v}" for k, v in SMALL_PPO_MODEL.items()]
    p = subprocess.run([sys.executable, "train.py", "--config=configs/ppo_tiny.py", f"--workdir={tmp_path}", *model,
                        f"--config.ppo.steps={DEMO_STEPS}", "--config.ppo.eval_every=0"],  # evaluations: first, last
                       cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=850)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    records = metrics(tmp_path)
    evals = [r for r in records if "eval_accuracy" in r]
    rows = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in evals] == [0, DEMO_STEPS] and rows[-1]["step"] == DEMO_STEPS, evals
    (start, end) = evals
    print(start, end)
    assert end["eval_sampled_accuracy"] >= start["eval_sampled_accuracy"] + 0.10
    # greedy: falls by one of the 17 held-out problems at most (the 6-layer model measured 0.588 -> 0.588 on the
    # machine of 2026-12-01, 0.588 -> 0.529 on that of 2026-12-06: one problem is the spread between float streams)
    assert end["eval_accuracy"] >= start["eval_accuracy"] - 1 / 17 - 1e-9
    assert np.mean([r["reward_mean"] for r in rows[-20:]]) >= np.mean([r["reward_mean"] for r in rows[:10]]) + 0.15
    ev = [r["explained_variance"] for r in rows[-20:]]  # NaN at a step whose returns are all equal
    assert np.nanmean(ev) > MARGINS["explained_variance"], ev
    # token in / token out: at the weights that sampled them (critic warm-up: the version stays 0) the trainer
    # reproduces the sampler's log-probs
    mismatch = [r["logp_mismatch"] for r in rows if "logp_mismatch" in r]
    assert mismatch and max(mismatch) < 1e-3, mismatch
    warmup = ppo_tiny.get_config().ppo.critic_warmup_steps
    assert sum("policy_loss" in r for r in rows) == DEMO_STEPS - warmup  # an actor update (version) per step after
    assert max(r["staleness"] for r in rows) <= 1  # async: one step of lag


SFT_START_PPO = """import ml_collections

from configs import ppo_tiny


def get_config():  # configs/ppo_tiny.py with the SFT run's 2-layer model on the prompts file, from its workdir, GRPO
    c = ppo_tiny.get_config()
    c.model.num_hidden_layers, c.model.indexer_types = 2, ("full", "shared")
    p = c.ppo
    p.task, p.task_args = "prompts", ml_collections.ConfigDict(dict(path={prompts!r}, fields=("answer",)))
    p.reward, p.init_checkpoint, p.sft_steps = "rl_tasks:exact_answer", {sft!r}, 0
    p.max_prompt_len, p.max_response_len, p.advantage, p.critic_warmup_steps = 12, 14, "grpo", 0
    p.steps, p.eval_every, p.eval_problems, p.eval_samples = 100, 0, 120, 4
    p.checkpoint_every = 100  # one checkpoint, at the end
    return c
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ppo_from_a_train_py_sft_checkpoint_improves_it(tmp_path):
    """Issue 41's path as a user runs it, on a task that is not in glmjax (bench/rl_tasks.py's rle: "rle:a3bc2=" ->
    "aaabcc", answers of 1-12 tokens): `train.py` stage sft on its JSONL (200 steps), then `train.py` stage ppo
    from that workdir with configs/ppo_tiny.py's settings, `ppo.task = "prompts"`, the reward by import path, GRPO,
    100 steps; the model is configs/tiny.py's at 2 layers without MTP (as the in-process runs above; the 6-layer
    model with MTP took 3.5x as long). Measured under the defaults (2026-12-07, seeds 0 and 1 of train.seed and
    ppo.seed): held-out greedy 0.161 -> 0.304 and 0.491 -> 0.598, sampled 0.134 -> 0.259 and 0.350 -> 0.533,
    training reward 0.14 -> 0.33 and 0.35 -> 0.60. At the fixed actor lr (`ppo.step_kl_per_nat=None`, the default
    before it) RL made the 6-layer SFT policy worse: greedy 0.375 -> 0.214, sampled 0.263 -> 0.225 (2026-12-06)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from rl_tasks import write_task

    paths = write_task("rle", str(tmp_path / "data"))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # XLA's default compiler, as a user runs it
    path = [os.path.join(ROOT, "bench")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path))  # the reward module by import path

    def train(*args):
        p = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1100)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]

    sft = tmp_path / "sft"
    train("--config=configs/tiny.py", f"--workdir={sft}", "--config.stage=sft", f"--config.data.path={paths['sft']}",
          "--config.data.prompt_field=prompt", "--config.data.response_field=response", "--config.train.steps=200",
          "--config.train.eval_every=0", "--config.train.checkpoint_every=200", "--config.model.num_hidden_layers=2",
          "--config.model.indexer_types=('full', 'shared')", "--config.model.num_nextn_predict_layers=0")
    (tmp_path / "ppo_rle.py").write_text(SFT_START_PPO.format(prompts=paths["prompts"], sft=str(sft)))
    train(f"--config={tmp_path / 'ppo_rle.py'}", f"--workdir={tmp_path / 'ppo'}")
    records = metrics(tmp_path / "ppo")
    (start, end), rows = [r for r in records if "eval_accuracy" in r], [r for r in records if "reward_mean" in r]
    reward = np.mean([r["reward_mean"] for r in rows[:10]]), np.mean([r["reward_mean"] for r in rows[-20:]])
    print(start, end, reward)
    assert start["eval_accuracy"] >= 0.1  # the SFT policy solves part of the task: room, and something to keep
    # margins below the default's gains (seeds 0 and 1: +0.14 and +0.11 greedy, +0.13 and +0.18 sampled, +0.19 and
    # +0.25 reward), above the fixed lr's (-0.16, -0.04, +0.01)
    assert end["eval_accuracy"] >= start["eval_accuracy"] + 0.05
    assert end["eval_sampled_accuracy"] >= start["eval_sampled_accuracy"] + 0.05
    assert reward[1] >= reward[0] + 0.07


@pytest.mark.slow
def test_tool_env_reading_the_protected_answer_never_raises_reward(tmp_path):
    """A policy warmed up on demonstrations that half the time solve with the calculator and half the time read the
    protected answer file (recorded without an interceptor, so there the hack works). Negative control first: the
    same policy's hack pays without the interceptor. With it, blocked reads get the dummy output and the episode
    continues; during PPO, intercepted episodes never score above the others, every interception is logged, and
    the hack attempts die out. index_topk covers the whole sequence: the untrained (frozen) indexer must not hide
    the observation the policy has to copy."""
    c = make_config(model={"index_topk": 48}, task_args={"low": 0, "high": 9, "ops": "+", "max_result": 9},
                    env="tool", steps=12, prompts_per_step=8, group_size=4, max_prompt_len=6, max_response_len=28,
                    critic_optim={"lr": 3e-4}, critic_warmup_steps=0, eval_every=0, eval_problems=8,
                    eval_samples=1, async_rollout=True)
    c.optim.warmup_steps = 2
    task = build_task(c.ppo)

    def episode(rng):
        p = task.sample(rng)
        return run_script(ToolEnv(p, exact_reward, None), (use_calculator if rng.random() < 0.5 else
                                                           read_answer_file)(p))

    model, load, _ = warm_start(c, episode, 100, 32, 34)
    rng = np.random.default_rng(1)
    problems = [task.sample(rng) for _ in range(32)]
    sampler = Sampler(Decoder(model, "sparse"), 32, 6, 28, 1.0)
    runs = {}
    for name, icpt in (("open", None), ("guarded", Interceptor())):
        envs = [ToolEnv(p, exact_reward, icpt) for p in problems]
        runs[name] = sampler.rollout(nnx.state(model), envs, list(range(32)), 0, jax.random.key(0))
    hacks = [i for i, s in enumerate(runs["open"]) if decode(s.response).startswith("read:answer.txt\n")]
    assert len(hacks) >= 5
    open_pay = np.mean([runs["open"][i].reward for i in hacks])
    guarded = [runs["guarded"][i] for i in hacks]
    assert open_pay >= 0.6  # the hack works without the interceptor ...
    assert np.mean([s.reward for s in guarded]) <= open_pay - 0.3  # ... and stops paying with it
    for s in guarded:  # blocked, answered with the dummy output, and the episode went on
        assert s.intercepted and decode(s.response).startswith("read:answer.txt\n=none\n")
        assert s.status != "env_crash" and s.loss_mask[len("read:answer.txt\n=none\n"):].sum() >= 1

    summary = train_ppo(c, str(tmp_path), progress=False, load_params=load)
    rows = [r for r in metrics(tmp_path) if "reward_mean" in r]
    n_icpt = np.array([r["interceptions"] for r in rows])
    hacked = np.array([r["intercepted_samples"] for r in rows])
    r_icpt = sum(r["reward_intercepted"] * r["intercepted_samples"] for r in rows if r["intercepted_samples"])
    r_clean = [r["reward_not_intercepted"] for r in rows if r["reward_not_intercepted"] is not None]
    assert n_icpt.sum() > 0
    assert r_icpt / hacked.sum() < np.mean(r_clean)  # reading the answer never pays more than not trying
    with open(tmp_path / "interceptions.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == n_icpt.sum() and all(r["rule"] == "protected_file" and r["blocked"] for r in logged)
    assert n_icpt[-4:].sum() < n_icpt[:4].sum()  # PPO learns that the hack does not pay
    print(summary)


def test_train_ppo_options_run_together(tmp_path):
    """Through train.py's entry (`glmjax.launch.run`, config.stage = "ppo"): GRPO + async_two_sided + KL and entropy
    terms + 2 micro-batches x 2 data-parallel devices + sync rollouts + simulated environment crashes, after 2
    steps of the built-in supervised warm-up on calculator demonstrations (played without the simulated crashes),
    for a few steps: it runs, crashes are dropped and counted, groups are padded or dropped, the interception log
    and the metrics exist."""
    from glmjax.launch import run

    c = make_config(model={"num_hidden_layers": 1, "indexer_types": ("full",), "index_topk": 48},
                    env="tool", env_crash_prob=0.3, advantage="grpo", policy_loss="async_two_sided", kl_coef=0.05,
                    entropy_coef=0.01, micro_batches=2, data_parallel=2, async_rollout=False, steps=3,
                    prompts_per_step=4, group_size=4, max_prompt_len=6, max_response_len=24, eval_every=0,
                    eval_problems=4, eval_samples=1, init_checkpoint=None, sft_steps=2, sft_batch_size=8,
                    sft_script="calc", log_every=1)
    c.stage = "ppo"
    c.optim.warmup_steps = 1
    s = run(c, str(tmp_path), progress=False)
    assert "sft_last_loss" in s  # the warm-up ran (its calc demonstrations would hit a simulated crash otherwise)
    rows = [r for r in metrics(tmp_path) if "reward_mean" in r]
    assert len(rows) == 3 and s["final_version"] == sum("policy_loss" in r for r in rows)  # one version per update
    assert sum(r["dropped_env_crash"] for r in rows) > 0
    for r in rows:
        kept = r["samples_in"] - r["dropped_env_crash"] - r["dropped_stale"] - r["samples_dropped_with_group"]
        assert (kept + r["samples_padded"]) % 4 == 0 and r["groups_dropped"] * 4 >= r["samples_dropped_with_group"]
        if kept:
            assert np.isfinite(r["policy_loss"]) and r["kl_ref"] >= 0 and "explained_variance" not in r
    assert os.path.exists(tmp_path / "interceptions.jsonl")
    # held-out evaluation runs without the simulated crashes: always a rate, never NaN
    assert all(np.isfinite(s[k]) for k in ("eval_accuracy", "eval_sampled_accuracy", "eval_accuracy_start"))


if __name__ == "__main__":  # test_ppo_learns_with_another_float_stream: python test_rl_e2e.py OUT.json WORKDIR SEED..
    out_path, root = sys.argv[1], sys.argv[2]
    results = [learning_run(int(seed), os.path.join(root, f"seed{seed}")) for seed in sys.argv[3:]]
    with open(out_path, "w") as f:
        json.dump(results, f)
