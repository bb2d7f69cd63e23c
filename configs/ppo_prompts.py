"""PPO on your own prompts with your own reward (README walkthrough; docs/ppo.md "Your own prompts"):

    glmjax-train --config=configs/ppo_prompts.py:ckpt/glm51 --workdir=runs/ppo \\
        --config.ppo.init_checkpoint=runs/sft --config.ppo.tokenizer=hf:GLM-5.1/ \\
        --config.ppo.task_args.path=prompts.jsonl --config.ppo.reward=my_rewards:exact_answer

The argument is the `glmjax-hf import` directory whose model_config.json is the model (the policy starts from it
unless ppo.init_checkpoint names an SFT workdir). GRPO (no critic), synchronous rollouts; the final policy is
written to workdir/policy for `glmjax-hf export`. Without an argument: configs/tiny.py's model.
"""
import json
import os

import ml_collections

from configs import tiny
from glmjax.optim.config import default_optim_config
from glmjax.rl.config import default_ppo_config


def get_config(ckpt_dir: str = ""):
    c = ml_collections.ConfigDict()
    c.stage = "ppo"
    if ckpt_dir:
        with open(os.path.join(ckpt_dir, "model_config.json")) as f:
            c.model = ml_collections.ConfigDict(json.load(f))
    else:
        c.model = tiny.get_config().model
    c.model.num_nextn_predict_layers = 0  # RL trains no MTP loss
    half = min(512, c.model.max_position_embeddings // 2)  # prompt and response lengths
    c.optim = default_optim_config(name="adamw", lr=1e-6, warmup_steps=5, weight_decay=0.0)
    c.ppo = default_ppo_config(
        task="prompts", task_args=ml_collections.ConfigDict(dict(path="prompts.jsonl", fields=("answer",))),
        reward="exact", init_checkpoint=ckpt_dir or None, steps=200, prompts_per_step=16, group_size=8,
        max_prompt_len=half, max_response_len=half, advantage="grpo", async_rollout=False, eval_every=20,
        eval_problems=64, eval_samples=4)
    return c
