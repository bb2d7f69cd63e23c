"""Compaction on a scripted episode (issue 47; glmjax/rl/compaction.py): a ToolEnv with a context budget, a scripted
policy and the built-in rule keep_last:1 give the sub-trajectories and prompts written out below by hand, and the
sampler plays the same sub-trajectories (`Sampler.play_episodes`)."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.config import ConfigError
from glmjax.rl.compaction import ASK, Budget, keep_last, make_budget, make_rule
from glmjax.rl.env import EOS, ToolEnv, play_script, run_script
from glmjax.rl.rollout import Sample, Sampler, filter_groups
from glmjax.rl.tasks import Problem
from glmjax.rl.text import TOK, encode
from test_rl import ScriptedDecoder


def calls_then_answer(n: int):
    """calc:1+0, calc:2+0, ... calc:n+0, then the last output as the answer."""
    return lambda obs: f"calc:{len(obs) + 1}+0\n" if len(obs) < n else obs[-1]


def test_a_scripted_episode_compacts_into_the_expected_sub_trajectories():
    """Budget 96 tokens per sub-trajectory, 8 kept free after an observation. The prompt is 5 tokens (BOS "3+4="),
    a call 9 ("calc:i+0\\n"), its output 3 ("=i\\n"): after call i the first sub-trajectory holds 5 + 12 i tokens,
    and call 7's output does not fit (5 + 12 * 6 + 9 + 3 + 8 = 97 > 96). The second starts from the compacted
    prompt: the task, the summary of calls 1-6 (61 tokens), call 7 and its output (78 tokens in all); call 8's output
    does not fit either (78 + 9 + 3 + 8 = 98), so the third starts from the task, the summary of calls 1-7, call 8
    and its output, and holds the answer."""
    env = ToolEnv(Problem("3+4=", "8"), lambda answer, problem: float(answer == problem.answer), max_calls=10,
                  budget=Budget(96, keep_last(1), headroom=8))
    subs = play_script(env, calls_then_answer(8))
    task = [TOK.BOS] + encode("3+4=")
    call, out = (lambda i: encode(f"calc:{i}+0\n")), (lambda i: encode(f"={i}\n"))
    summary6 = encode("[earlier: 6 turns, the last 2: calc:5+0 -> 5; calc:6+0 -> 6]\n")
    summary7 = encode("[earlier: 7 turns, the last 2: calc:6+0 -> 6; calc:7+0 -> 7]\n")
    assert len(summary6) == 61 and len(task + summary6 + call(7) + out(7)) == 78
    want = [
        (task, sum((call(i) + out(i) for i in range(1, 7)), []) + call(7), ([1] * 9 + [0] * 3) * 6 + [1] * 9),
        (task + summary6 + call(7) + out(7), call(8), [1] * 9),
        (task + summary7 + call(8) + out(8), encode("8") + [EOS], [1, 1]),
    ]
    assert [s[0] for s in subs] == [w[0] for w in want]  # the prompts
    assert subs == want
    assert env.budget.compactions == 2 and env.reward() == 1.0  # the episode's reward, once, at its end
    assert all(len(p) + len(r) <= 96 for p, r, _ in subs)


def test_without_a_budget_nothing_changes():
    env = ToolEnv(Problem("3+4=", "3"), lambda a, p: 0.0, max_calls=10)
    prompt, response, mask = run_script(env, calls_then_answer(3))
    assert prompt == [TOK.BOS] + encode("3+4=") and sum(mask) == 3 * 9 + 2 and len(response) == 3 * 12 + 2


def test_rules_and_their_errors():
    with pytest.raises(ConfigError, match="k must be >= 1"):
        make_rule("keep_last:0")
    with pytest.raises(ConfigError, match="keep_last takes an integer"):
        make_rule("keep_last:two")
    assert make_rule("keep_last:2")([1], [([2], [3]), ([4], [5]), ([6], [7])], None)[-4:] == [4, 5, 6, 7]
    env = ToolEnv(Problem("3+4=", "3"), lambda a, p: 0.0, max_calls=10, budget=Budget(40, keep_last(2), headroom=8))
    # call 3's output does not fit (5 + 24 + 9 + 3 + 8 = 49 > 40); the task, the summary of call 1 and calls 2-3
    # with their outputs make 5 + 45 + 24 = 74 tokens, over the 32 that leave room for a turn: the prompt keeps the
    # task and the last 27 tokens (the end of call 2's output, call 3 and its output)
    assert len(encode("[earlier: 1 turn, the last 1: calc:1+0 -> 1]\n")) == 45
    subs = play_script(env, lambda obs: "calc:1+0\n" if len(obs) < 3 else "3")
    full = [TOK.BOS] + encode("3+4=[earlier: 1 turn, the last 1: calc:1+0 -> 1]\ncalc:1+0\n=1\ncalc:1+0\n=1\n")
    assert subs[1][0] == full[:5] + full[-27:] and env.budget.clipped >= 1
    tight = ToolEnv(Problem("3+4=", "3"), lambda a, p: 0.0, max_calls=10, budget=Budget(12, keep_last(1), headroom=8))
    with pytest.raises(ConfigError, match="the task's prompt has 5 tokens, leaving fewer than 8"):
        play_script(tight, calls_then_answer(3))


class CallingDecoder(ScriptedDecoder):
    """Stands in for glmjax.infer.Decoder (test_rl's, with another policy): every row plays calls_then_answer(n) --
    calc:1+0, calc:2+0, ... then the last output -- reading the whole history, prompt included, so it goes on from a
    compacted prompt."""

    def __init__(self, n: int, task: str):
        self.n, self.task = n, task

    def logits(self, hist):
        out = np.full((len(hist), 512), -1e9, np.float32)
        for b, h in enumerate(hist):
            text = bytes(t for t in h if t < 256).decode()
            calls = re.findall(r"calc:(\d+)\+0\n", text)
            done = int(calls[-1]) if calls else 0
            partial = text.rsplit("\n", 1)[-1] if "\n" in text else text[len(self.task):]
            turn = encode(f"calc:{done + 1}+0\n") if done < self.n else encode(str(done)) + [EOS]
            out[b, turn[min(len(partial), len(turn) - 1)]] = 0
        return jnp.asarray(out)


def test_the_sampler_plays_the_sub_trajectories_a_script_plays():
    """`Sampler.play_episodes` with a budget: the same sub-trajectories as play_script (the hand-checked episode
    above), tagged episode / segment, each carrying the episode's reward; an environment without a budget beside it
    is one sample, as `rollout` gives it."""
    def env(budget):
        return ToolEnv(Problem("3+4=", "8"), lambda answer, problem: float(answer == problem.answer), max_calls=10,
                       budget=Budget(96, keep_last(1), headroom=8) if budget else None)

    want = play_script(env(True), calls_then_answer(8))
    smp = Sampler(CallingDecoder(8, "3+4="), batch_size=2, max_prompt_len=96, max_response_len=128)
    got = smp.play_episodes(None, [env(True), env(False)], [0, 1], version=3, key=jax.random.key(0))
    assert [(s.episode, s.segment, s.status) for s in got] == [(0, 0, "compacted"), (0, 1, "compacted"),
                                                               (0, 2, "ok"), (1, 0, "ok")]
    for s, (prompt, response, mask) in zip(got, want):
        assert s.prompt.tolist() == prompt and s.response.tolist() == response and s.loss_mask.tolist() == mask
    assert all(s.reward == 1.0 for s in got)
    plain = Sampler(CallingDecoder(8, "3+4="), 1, 96, 128).rollout(None, [env(False)], [1], 3, jax.random.key(0))[0]
    assert got[3].response.tolist() == plain.response.tolist() and got[3].reward == plain.reward == 1.0


def test_filter_groups_counts_episodes_not_sub_trajectories():
    """Group of 4 (group_size 4): episode 0 compacted into 2 sub-trajectories, episode 1 one, episode 2 crashed,
    episode 3 one: 3 valid episodes > 2 are kept and padded to 4 with a copy of episode 0 under a new id."""
    def piece(episode, segment, status="ok"):
        return Sample(np.array([1]), np.array([2]), np.ones(1, np.float32), np.zeros(1, np.float32), 5, status, 0,
                      1.0, {}, episode, segment)

    samples = [piece(0, 0, "compacted"), piece(0, 1), piece(1, 0), piece(2, 0, "env_crash"), piece(3, 0)]
    kept, counts = filter_groups(samples, 5, 2, 4)
    assert [(s.episode, s.segment) for s in kept] == [(0, 0), (0, 1), (1, 0), (3, 0), (4, 0), (4, 1)]
    assert counts["dropped_env_crash"] == 1 and counts["samples_padded"] == 2 and counts["groups_padded"] == 1


@pytest.mark.slow
def test_a_ppo_step_runs_on_compacted_episodes(tmp_path, monkeypatch):
    """Through train.py's entry (`glmjax.launch.run`): the tool environment after a supervised warm-up on calculator
    demonstrations (a call, its output, the answer), a 16-token budget that the call and its output overflow, and a
    user rule (the task and the end of the last output): episodes go on in a second sub-trajectory, GAE runs along
    them, the steps train and log sub-trajectories per episode."""
    from bench.fault_injection import SMALL_PPO_MODEL
    from configs import ppo_tiny
    from glmjax.launch import run

    (tmp_path / "user_compaction.py").write_text(
        "def last_output(prompt, turns, text):\n    return list(prompt) + list(turns[-1][1])[-3:]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = ppo_tiny.get_config()
    c.model.update(SMALL_PPO_MODEL)  # bench/fault_injection.py's PPO_FLAGS' model: a fifth of the compile time
    c.ppo.update(env="tool", sft_script="calc", sft_steps=30, sft_batch_size=32, prompts_per_step=4, group_size=2,
                 steps=3, critic_warmup_steps=1, async_rollout=False, eval_every=0, eval_problems=8, eval_samples=1,
                 max_prompt_len=12, max_response_len=16, context_budget=16, compaction_headroom=4,
                 compaction="user_compaction:last_output", max_sub_trajectories=3, log_every=1)
    c.optim.warmup_steps = 1
    s = run(c, str(tmp_path / "run"), progress=False)
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in x]
    assert len(rows) == 3 and all(np.isfinite(r["value_loss"]) for r in rows)
    assert np.mean([r["sub_trajectories_per_episode"] for r in rows]) > 1.5, rows  # most episodes compact
    assert sum(r["compactions"] for r in rows) > 0 and all(r["sub_trajectory_len_mean"] <= 16 for r in rows)
    assert np.isfinite(s["eval_accuracy"])


def test_a_summary_written_by_the_policy_is_its_own_tokens():
    """policy_summary:1, budget 160 with 80 kept free: call 7's output overflows (5 + 12 * 6 + 9 + 3 + 80 = 169 >
    160); the environment shows the output and ASK (loss mask 0), the policy's summary turn is policy tokens of the
    first sub-trajectory, and the second starts from the task, "[summary: ...]" and call 7 with its output."""
    def policy(obs):
        if obs and obs[-1].endswith(ASK.strip()):
            return "calls 1-7 returned 1-7\n"
        done = sum(not o.startswith("[") and "[context" not in o for o in obs)
        return f"calc:{done + 1}+0\n" if done < 8 else "8"

    env = ToolEnv(Problem("3+4=", "8"), lambda answer, problem: float(answer == problem.answer), max_calls=10,
                  budget=make_budget("policy_summary:1", 160, 80))
    subs = play_script(env, policy)
    task = [TOK.BOS] + encode("3+4=")
    call, out = (lambda i: encode(f"calc:{i}+0\n")), (lambda i: encode(f"={i}\n"))
    summary = encode("calls 1-7 returned 1-7\n")
    first = sum((call(i) + out(i) for i in range(1, 7)), []) + call(7) + out(7) + encode(ASK) + summary
    first_mask = ([1] * 9 + [0] * 3) * 6 + [1] * 9 + [0] * (3 + len(encode(ASK))) + [1] * len(summary)
    second_prompt = task + encode("[summary: calls 1-7 returned 1-7]\n") + call(7) + out(7)
    assert subs == [(task, first, first_mask), (second_prompt, call(8) + out(8) + encode("8") + [EOS],
                                                [1] * 9 + [0] * 3 + [1, 1])]
    assert env.budget.compactions == 1 and env.reward() == 1.0
