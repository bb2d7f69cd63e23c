"""PPO post-training (GLM-5 / GLM-5.2 style): verifiable tasks (demos, or your prompts JSONL with a reward by import
path, rendered by the checkpoint's tokenizer and chat template) and tool environments with reward-hacking
interception, a lockstep rollout sampler on the MLA-cache decoder with an asynchronous worker, token-level GAE with a
value-head critic (or GRPO), PPO-clip / asynchronous two-sided / IcePop policy losses with exact global token-mean
normalisation. Entry point: `train_ppo(config, workdir)`."""
from glmjax.rl.config import default_ppo_config, validate_ppo_config
from glmjax.rl.ppo import train_ppo

__all__ = ["default_ppo_config", "train_ppo", "validate_ppo_config"]
