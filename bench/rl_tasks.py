"""The post-training task family of bench/ppo_curves.py --tasks (issue 41): three tasks a user could have
brought, each run the way a user runs one -- an SFT JSONL through `train.py` stage `sft`, then `ppo.task =
"prompts"` on a prompts JSONL with a reward by import path (`rl_tasks:exact_answer`, this directory on sys.path).

  arith  "37+85=" -> "122": sums with answers of 1, 2 and 3 digits (a third of the problems each)
  rle    "rle:a3bc2=" -> "aaabcc": run-length decoding, 1-3 runs of 1-4 letters, answers of 1 to 12 characters
  tool   "17*23+5=" -> "396", multi-turn: the policy may call the calculator ("calc:17*23+5\\n", answered
         "=396\\n", loss-masked) and then answer; its SFT data answers half of the problems directly (which the
         tiny model mostly gets wrong) and half through the tool, so RL has to learn when to call it

Prompts and SFT problems are disjoint (the prompts file's problems never appear in the SFT data). Byte tokens
throughout: SFT pairs `prompt` / `response` (arith, rle) or pre-tokenized rows with a loss mask that leaves the tool
output out (tool, `data.tokens_field`), exactly the tokens PPO's byte rule produces (BOS + prompt, EOS at the end).

    from rl_tasks import TASKS, write_task, sft_config, ppo_config
    paths = write_task("arith", "runs/arith")            # -> {"sft": ..., "prompts": ...}
    glmjax.launch.run(sft_config("arith", paths), "runs/arith/sft")
    glmjax.launch.run(ppo_config("arith", paths, "runs/arith/sft", "gae", seed=0), "runs/arith/ppo")
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BOS, EOS = 256, 257  # glmjax.data.ByteTokenizer


def exact_answer(response: str, problem) -> float:
    """The reward of every task: 1 for exactly the row's answer (surrounding whitespace ignored), else 0."""
    return float(response.strip() == problem.row["answer"])


def sum_problem(rng: random.Random) -> tuple[str, str]:
    digits = rng.choice((1, 2, 3))
    while True:
        a, b = rng.randrange(0, 100), rng.randrange(0, 100)
        if len(str(a + b)) == digits:
            return f"{a}+{b}=", str(a + b)


def rle_problem(rng: random.Random) -> tuple[str, str]:
    runs, last = [], None
    for _ in range(rng.randint(1, 3)):
        letter = rng.choice([c for c in "abcd" if c != last])
        runs.append((letter, rng.randint(1, 4)))
        last = letter
    return "rle:" + "".join(c + (str(n) if n > 1 else "") for c, n in runs) + "=", "".join(c * n for c, n in runs)


def sort_problem(rng: random.Random) -> tuple[str, str]:
    letters = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 6)))
    return f"sort:{letters}=", "".join(sorted(letters))


def tool_problem(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(11, 39), rng.randint(11, 39), rng.randint(0, 99)
    return f"{a}*{b}+{c}=", str(a * b + c)


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def tool_row(prompt: str, answer: str, use_tool: bool) -> dict:
    """A pre-tokenized SFT row: BOS + prompt, then either the answer + EOS, or the calculator call, its output
    (mask 0) and the answer + EOS -- token for token what glmjax.rl.env.ToolEnv feeds the policy."""
    head = [BOS] + byte_ids(prompt)
    turns = [(byte_ids(f"calc:{prompt[:-1]}\n"), 1), (byte_ids(f"={answer}\n"), 0)] if use_tool else []
    turns.append((byte_ids(answer) + [EOS], 1))
    tokens, mask = list(head), [0] * len(head)
    for ids, m in turns:
        tokens += ids
        mask += [m] * len(ids)
    return {"tokens": tokens, "loss_mask": mask}


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    problem: Callable[[random.Random], tuple[str, str]]
    sft_steps: int  # SFT steps that leave room for RL (a policy that solves part of the task)
    max_prompt_len: int
    max_response_len: int
    env: str = "single_turn"
    n_prompts: int = 400  # rows of the prompts file (30% held out)
    n_sft: int = 6000  # rows of the SFT file


TASKS = {
    # the SFT loss plateaus near 1.4, then drops at a step that depends on the machine's float stream: held-out
    # greedy after 300 / 550 / 900 steps was 0.068 / 0.573 / 0.684 on one machine, 550 / 900 steps 0.085 / 0.547
    # on another (docs/ppo.md); 900 leaves RL room on both. 2,000 prompts: a training prompt comes back less than
    # twice in 150 steps (RL cannot memorise them), and 600 held out
    "arith": TaskSpec(sum_problem, sft_steps=900, max_prompt_len=7, max_response_len=5, n_prompts=2000),
    "rle": TaskSpec(rle_problem, sft_steps=200, max_prompt_len=12, max_response_len=14),
    # sort: held-out greedy 0.39 after 100 SFT steps, 0.96 after 200 (one machine): 100 leaves RL room
    "sort": TaskSpec(sort_problem, sft_steps=100, max_prompt_len=13, max_response_len=8),
    "tool": TaskSpec(tool_problem, sft_steps=200, max_prompt_len=10, max_response_len=24, env="tool"),
}


PROMPT_SHARE = 0.25  # of every task's problem space, by a hash of the prompt: the prompts file's side


def on_prompt_side(prompt: str) -> bool:
    """Whether a problem may go to the prompts file (else only to the SFT file): a fixed share of the problem space,
    chosen by a hash of its prompt, so both files draw from every kind of problem. Drawn first into the prompts
    file, a kind with few distinct problems was used up there: arith's sums below 10 (55 problems) gave the prompts
    file 54 and the SFT file 1, and the SFT policy never learnt one-digit answers (docs/ppo.md)."""
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) < PROMPT_SHARE * 16 ** 8


def write_task(name: str, directory: str, seed: int = 0) -> dict:
    """sft.jsonl and prompts.jsonl of task `name` in `directory` -> their paths {"sft", "prompts"}. The prompts
    file's problems are distinct and none of them is in the SFT file (`on_prompt_side` splits the problems)."""
    spec, rng = TASKS[name], random.Random(f"{name}-{seed}")
    os.makedirs(directory, exist_ok=True)
    prompts: dict[str, str] = {}
    sft: list[tuple[str, str]] = []
    while len(prompts) < spec.n_prompts or len(sft) < spec.n_sft:
        q, a = spec.problem(rng)
        if on_prompt_side(q):
            if len(prompts) < spec.n_prompts:
                prompts.setdefault(q, a)
        elif len(sft) < spec.n_sft:
            sft.append((q, a))
    paths = {"sft": os.path.join(directory, "sft.jsonl"), "prompts": os.path.join(directory, "prompts.jsonl")}
    with open(paths["prompts"], "w") as f:
        for q, a in prompts.items():
            f.write(json.dumps({"prompt": q, "answer": a}) + "\n")
    with open(paths["sft"], "w") as f:
        for n, (q, a) in enumerate(sft):
            row = tool_row(q, a, use_tool=n % 2 == 1) if spec.env == "tool" else {"prompt": q, "response": a}
            f.write(json.dumps(row) + "\n")
    return paths


def sft_config(name: str, paths: dict, steps: int | None = None):
    """configs/tiny.py as stage `sft` on the task's SFT file (what `train.py --config=configs/tiny.py
    --config.stage=sft --config.data.path=... --config.data.prompt_field=prompt ...` builds)."""
    from configs import tiny

    c = tiny.get_config()
    c.stage = "sft"
    c.train.steps = steps or TASKS[name].sft_steps
    c.train.eval_every = 0
    c.train.checkpoint_every = c.train.steps
    c.data.path = paths["sft"]
    if TASKS[name].env == "tool":
        c.data.tokens_field, c.data.loss_mask_field = "tokens", "loss_mask"
    else:
        c.data.prompt_field, c.data.response_field = "prompt", "response"
    return c


def ppo_config(name: str, paths: dict, sft_workdir: str, advantage: str, seed: int = 0, steps: int | None = None):
    """configs/ppo_tiny.py on the task's prompts file, from the SFT workdir: ppo.task = "prompts", the reward by
    import path, no supervised warm-up; advantage "gae" (critic PPO) or "grpo"."""
    import ml_collections

    from configs import ppo_tiny

    spec, c = TASKS[name], ppo_tiny.get_config()
    p = c.ppo
    p.task, p.task_args = "prompts", ml_collections.ConfigDict({"path": paths["prompts"]})
    p.reward, p.env, p.init_checkpoint, p.sft_steps = "rl_tasks:exact_answer", spec.env, sft_workdir, 0
    p.max_prompt_len, p.max_response_len, p.seed = spec.max_prompt_len, spec.max_response_len, seed
    p.advantage = advantage
    p.eval_every, p.eval_problems, p.eval_samples = 10, 240, 4
    if advantage == "grpo":
        p.critic_warmup_steps = 0
    if steps:
        p.steps = steps
    return c
