"""Learning-rate schedules of the recipe: linear warmup from 0, then cosine decay or constant."""
from __future__ import annotations

import optax


def make_schedule(peak: float, warmup_steps: int, total_steps: int, kind: str = "cosine",
                  end_lr_ratio: float = 0.1) -> optax.Schedule:
    """lr(step) for step = 0, 1, ...: 0 -> peak linearly over `warmup_steps`, then

    "cosine":   peak -> peak * end_lr_ratio along a half cosine, reached at `total_steps` and held after;
    "constant": peak.
    """
    if kind not in ("cosine", "constant"):
        raise ValueError(f"schedule kind {kind!r}: must be 'cosine' or 'constant'")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps={warmup_steps}: must be in [0, total_steps={total_steps})")
    if kind == "cosine":
        decay = optax.cosine_decay_schedule(peak, total_steps - warmup_steps, alpha=end_lr_ratio)
    else:
        decay = optax.constant_schedule(peak)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])
