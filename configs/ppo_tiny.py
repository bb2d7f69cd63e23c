"""PPO on single-digit sums (a + b <= 9, 30% of the problems held out) with the docs/model.md A.5 tiny model: a brief
supervised warm-up on demonstrations, then critic PPO (token-level GAE, PPO-clip, 2 epochs x 2 mini-batches per
rollout batch) with asynchronous rollouts. A few minutes on a CPU:

    python -c "from configs import ppo_tiny; from glmjax.rl import train_ppo
    train_ppo(ppo_tiny.get_config(), 'runs/ppo')"

(train.py dispatches `--config.stage=ppo` to train_ppo.) The MTP layer is off: RL trains no MTP loss.
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
    c.optim = default_optim_config(name="adamw", lr=2e-4, warmup_steps=10, weight_decay=0.0)  # the actor's
    c.ppo = default_ppo_config(
        task="arithmetic", task_args=dict(low=0, high=9, ops="+", max_result=9), heldout_fraction=0.3,
        reward="exact", steps=150, prompts_per_step=16, group_size=4, max_prompt_len=6, max_response_len=4,
        sft_steps=60, sft_batch_size=64, sft_lr=3e-3,
        advantage="gae", policy_loss="ppo_clip", ppo_epochs=2, minibatches=2,
        critic_optim=dict(lr=1e-3), critic_warmup_steps=10,
        async_rollout=True, eval_every=25, eval_problems=64, eval_samples=16)
    return c
