"""The `train` section of an experiment config: defaults and up-front validation."""
from __future__ import annotations

import ml_collections

from glmjax.config import ConfigError

MODES = ("dense", "sparse")


def default_train_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.seq_len = 128
    c.batch_size = 8
    c.steps = 300
    c.mode = "sparse"  # attention mode: "dense" | "sparse" (DSA top-k)
    c.bias_update_rate = 1e-3  # aux-loss-free balancing: bias += rate * sign(mean load - load); 0 disables
    c.log_every = 10
    c.eval_every = 100  # 0 disables periodic eval (a final eval still runs when eval_batches > 0)
    c.eval_batches = 4
    c.eval_fraction = 0.02  # share of documents held out for eval
    c.data = ml_collections.config_dict.placeholder(str)  # None -> embedded stdlib corpus; else text/JSONL path
    c.max_docs = ml_collections.config_dict.placeholder(int)  # None -> all documents
    c.update(overrides)
    return c


def validate_train_config(t, model_cfg, tokenizer_vocab: int) -> None:
    """t: the train ConfigDict; model_cfg: the validated ModelConfig."""
    def fail(field, rule):
        raise ConfigError(f"train.{field}={t[field]!r}: {rule}")

    for name in ("seq_len", "batch_size", "steps", "log_every"):
        if not isinstance(t[name], int) or t[name] < 1:
            fail(name, "must be an integer >= 1")
    for name in ("eval_every", "eval_batches"):
        if not isinstance(t[name], int) or t[name] < 0:
            fail(name, "must be an integer >= 0")
    if t.bias_update_rate < 0:
        fail("bias_update_rate", "must be >= 0")
    if not 0 <= t.eval_fraction < 1:
        fail("eval_fraction", "must be in [0, 1)")
    if t.eval_batches and not t.eval_fraction:
        fail("eval_batches", "needs eval_fraction > 0 (no held-out documents)")
    if t.mode not in MODES:
        fail("mode", f"must be one of {MODES}")
    if t.max_docs is not None and t.max_docs < 2:
        fail("max_docs", "must be >= 2 (one train and one held-out document) or None")
    if t.seq_len > model_cfg.max_position_embeddings:
        fail("seq_len", f"must be <= model.max_position_embeddings={model_cfg.max_position_embeddings}")
    if model_cfg.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size}: must be >= {tokenizer_vocab} "
                          "(byte tokenizer vocabulary)")
