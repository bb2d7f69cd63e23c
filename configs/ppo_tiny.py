"""PPO on single-digit addition with the SPEC A.5 tiny model: a brief supervised warm-up on demonstrations, then
critic PPO (token-level GAE) with asynchronous rollouts. Minutes on a CPU:

    python -c "from configs import ppo_tiny; from glmjax.rl import train_ppo; train_ppo(ppo_tiny.get_config(), 'runs/ppo')"

(train.py will dispatch `--config.stage=ppo` here.) The MTP layer is off: RL trains no MTP loss.
"""
import ml_collections

from configs import tiny
from glmjax.optim.config import default_optim_config
from glmjax.rl.config import default_ppo_config


def get_config():
    c = ml_collections.ConfigDict()
    c.stage = "ppo"
    c.model = tiny.get_config().model
    c.model.num_nextn_predict_layers = 0
    c.optim = default_optim_config(name="adamw", lr=3e-4, warmup_steps=5, weight_decay=0.0)  # the actor's
    c.ppo = default_ppo_config(
        task="arithmetic", task_args=dict(low=0, high=9, ops="+"), reward="exact",
        steps=100, prompts_per_step=16, group_size=4, max_prompt_len=8, max_response_len=8,
        sft_steps=60, sft_batch_size=64, sft_lr=3e-3,
        advantage="gae", policy_loss="ppo_clip", critic_optim=dict(lr=3e-3), critic_warmup_steps=2,
        async_rollout=True, eval_every=10, eval_problems=64)
    return c
