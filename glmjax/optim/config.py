"""The `optim` section of an experiment config: defaults and up-front validation.

Every error names the field, the value and the rule (a `glmjax.config.ConfigError`).
"""
from __future__ import annotations

import math

import ml_collections

from glmjax.config import ConfigError

NAMES = ("adamw", "muon", "muon_split")
SCHEDULES = ("cosine", "constant")
SPLIT_ROPE = ("together", "separate")
INDEXER_OPTIMIZERS = ("adamw", "muon")


def default_optim_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "muon_split"  # "adamw" | "muon" (whole matrices) | "muon_split" (MLA up-projections per head)
    # Peak learning rates, one per group. None -> `lr`. With consistent_rms the Muon update has AdamW's RMS, so
    # muon_lr = lr is the natural starting point (Moonlight recipe).
    c.lr = 3e-3  # AdamW group (embeddings, LM head, norms, router); every non-indexer parameter under "adamw"
    c.muon_lr = ml_collections.config_dict.placeholder(float)
    c.indexer_lr = ml_collections.config_dict.placeholder(float)
    c.schedule = "cosine"  # linear warmup from 0, then "cosine" decay to lr*end_lr_ratio at total_steps, or "constant"
    c.warmup_steps = 30
    c.total_steps = 300
    c.end_lr_ratio = 0.1
    c.weight_decay = 0.1  # decoupled (multiplied by the scheduled lr), on matrices and embeddings, never on norms
    c.b1 = 0.9
    c.b2 = 0.95
    c.eps = 1e-8
    c.momentum = 0.95  # Muon momentum
    c.nesterov = True
    c.ns_steps = 5  # Newton-Schulz iterations with the quintic (3.4445, -4.7750, 2.0315)
    # Muon update scale: consistent_rms * sqrt(max(fan_in, fan_out)) per orthogonalised matrix, so the update RMS is
    # ~consistent_rms for every shape (AdamW's typical update RMS is 0.2-0.4). None -> Keller Jordan's width scale
    # sqrt(max(1, fan_out / fan_in)) (needs a separately tuned muon_lr).
    c.consistent_rms = 0.2
    c.grad_clip = 1.0  # global-norm clip over the LM-loss parameters (everything but the indexer); 0 disables
    c.indexer_grad_clip = ml_collections.config_dict.placeholder(float)  # own clip for indexer grads; None -> grad_clip
    c.split_rope = "together"  # muon_split: a head's rope columns of q_b_proj orthogonalised with its nope columns
    c.split_o_proj = False  # muon_split: o_proj per head as well
    c.indexer_optimizer = "adamw"  # indexer wq_b / wk: "adamw" or "muon" (weights_proj and k_norm: always AdamW)
    c.update(overrides)
    return c


def validate_optim_config(c) -> dict:
    """Check every field of an optim config (ConfigDict or dict); -> a plain dict with defaults filled in."""
    defaults = default_optim_config()
    given = dict(c.to_dict() if hasattr(c, "to_dict") else c)
    unknown = sorted(set(given) - set(defaults.keys()))
    if unknown:
        raise ConfigError(f"optim.{unknown[0]}: unknown field (known fields: {', '.join(sorted(defaults.keys()))})")
    d = {**defaults.to_dict(), **given}

    def fail(field, rule):
        raise ConfigError(f"optim.{field}={d[field]!r}: {rule}")

    def number(field, allow_none=False):
        v = d[field]
        if v is None and allow_none:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(field, "must be a finite number" + (" or None" if allow_none else ""))

    def integer(field, minimum):
        v = d[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            fail(field, f"must be an integer >= {minimum}")

    def choice(field, options):
        if d[field] not in options:
            fail(field, f"must be one of {list(options)}")

    choice("name", NAMES)
    choice("schedule", SCHEDULES)
    choice("split_rope", SPLIT_ROPE)
    choice("indexer_optimizer", INDEXER_OPTIMIZERS)
    for field in ("nesterov", "split_o_proj"):
        if not isinstance(d[field], bool):
            fail(field, "must be True or False")
    for field in ("lr", "muon_lr", "indexer_lr"):
        number(field, allow_none=field != "lr")
        if d[field] is not None and not d[field] > 0:
            fail(field, "must be > 0")
    integer("total_steps", 1)
    integer("warmup_steps", 0)
    integer("ns_steps", 1)
    if d["warmup_steps"] >= d["total_steps"]:
        fail("warmup_steps", f"must be < total_steps={d['total_steps']}")
    for field in ("end_lr_ratio", "weight_decay", "grad_clip", "indexer_grad_clip", "eps"):
        number(field, allow_none=field == "indexer_grad_clip")
        if d[field] is not None and d[field] < 0:
            fail(field, "must be >= 0")
    if d["end_lr_ratio"] > 1:
        fail("end_lr_ratio", "must be <= 1 (the decayed lr is lr * end_lr_ratio)")
    for field in ("b1", "b2", "momentum"):
        number(field)
        if not 0 <= d[field] < 1:
            fail(field, "must be in [0, 1)")
    number("consistent_rms", allow_none=True)
    if d["consistent_rms"] is not None and not d["consistent_rms"] > 0:
        fail("consistent_rms", "must be > 0, or None for width scaling")
    if d["muon_lr"] is None:
        d["muon_lr"] = d["lr"]
    if d["indexer_lr"] is None:
        d["indexer_lr"] = d["lr"]
    if d["indexer_grad_clip"] is None:
        d["indexer_grad_clip"] = d["grad_clip"]
    return d
