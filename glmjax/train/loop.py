"""The training loop: data -> model -> jitted steps -> metrics (JSONL + tqdm)."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from glmjax.config import ModelConfig
from glmjax.data import ByteTokenizer, Packer, load_corpus, split_documents
from glmjax.model.transformer import GLM, Batch
from glmjax.optim import validate_optim_config
from glmjax.train.config import validate_train_config
from glmjax.train.step import count_params, make_eval_step, make_optimizer, make_train_step, split_model


def to_batch(b: dict) -> Batch:
    return Batch(b["tokens"], b["segment_ids"], b["positions"])


def evaluate(eval_step, params, rest, batches) -> dict:
    """Token-mean LM loss over all eval batches (exact: sums of NLL / counts), plus the mean MTP loss."""
    outs = [jax.device_get(eval_step(params, rest, to_batch(b))) for b in batches]
    m = {"eval_loss": float(sum(o["lm_nll_sum"] for o in outs) / max(sum(o["lm_tokens"] for o in outs), 1.0))}
    if "mtp_loss" in outs[0]:
        m["eval_mtp_loss"] = float(np.mean([o["mtp_loss"] for o in outs]))
    return m


def train(config, workdir: str, progress: bool = True) -> dict:
    """Train `config.model` with `config.train`; writes workdir/{config.json,metrics.jsonl}. -> summary dict."""
    t0 = time.perf_counter()
    t = config.train
    cfg = ModelConfig.from_dict(config.model)
    tok = ByteTokenizer()
    validate_train_config(t, cfg, tok.vocab_size)
    validate_optim_config({**config.optim.to_dict(), "total_steps": t.steps})
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))

    corpus = load_corpus(t.data, t.max_docs)
    train_docs, eval_docs = split_documents([d.text for d in corpus.documents], t.eval_fraction, t.seed)
    data = Packer(train_docs, tok, t.seq_len, t.batch_size, t.seed)
    eval_set = Packer(eval_docs, tok, t.seq_len, t.batch_size).batches(t.eval_batches) if t.eval_batches else []
    print(f"data: {corpus.source}: {len(train_docs)} train docs ({data.num_tokens:,} tokens), {len(eval_docs)} "
          f"held-out docs ({len(eval_set)} eval batches), {corpus.skipped} skipped")

    model = GLM(cfg, nnx.Rngs(t.seed))
    graphdef, params, rest = split_model(model)
    n_train, n_frozen = count_params(params), count_params(nnx.state(model, nnx.Param)) - count_params(params)
    print(f"params: {n_train + n_frozen:,} ({n_train:,} trainable, {n_frozen:,} frozen indexer); "
          f"mode={t.mode}, {t.batch_size}x{t.seq_len} tokens/step, {t.steps} steps")
    del model

    tx, groups = make_optimizer(params, config.optim, t.steps, cfg)
    print(groups)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx, t.mode, t.bias_update_rate)
    eval_step = make_eval_step(graphdef, t.mode)

    it = iter(data)
    start = time.perf_counter()
    summary: dict = {"params": n_train + n_frozen, "trainable_params": n_train, "setup_s": start - t0}
    window_t, window_tokens, timed_tokens, timed_s = start, 0, 0, 0.0
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as out, \
            tqdm(total=t.steps, disable=not progress, dynamic_ncols=True) as bar:
        def write(record):
            out.write(json.dumps(record) + "\n")
            out.flush()

        for step in range(1, t.steps + 1):
            b = next(it)
            params, rest, opt_state, m = train_step(params, rest, opt_state, to_batch(b))
            window_tokens += int(np.sum(b["segment_ids"] > 0))
            bar.update(1)
            if step == 1 or step % t.log_every == 0 or step == t.steps:
                m = jax.device_get(m)
                now = time.perf_counter()
                if step > 1:  # the first step compiles: it is timed on its own, not counted in tokens/s
                    timed_tokens, timed_s = timed_tokens + window_tokens, timed_s + now - window_t
                else:
                    summary["first_step_s"], summary["first_loss"] = now - start, float(m["loss"])
                tps = window_tokens / max(now - window_t, 1e-9)
                record = {"step": step, **{k: float(v) for k, v in m.items() if np.ndim(v) == 0},
                          **{f"lr_{g}": float(s(step - 1)) for g, s in groups.schedules.items()},
                          "tokens_per_s": tps, "wall_s": now - start}
                write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}")
                summary["last_loss"] = record["loss"]
                window_t, window_tokens = time.perf_counter(), 0
            if eval_set and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
                e0 = time.perf_counter()
                e = evaluate(eval_step, params, rest, eval_set)
                write({"step": step, **e})
                bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items()))
                summary.update(e)
                window_t += time.perf_counter() - e0  # eval time is not training throughput
    summary["tokens_per_s"] = timed_tokens / timed_s if timed_s else float("nan")
    summary["train_s"] = time.perf_counter() - start
    summary["wall_s"] = time.perf_counter() - t0
    print("done: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v:,}" for k, v in summary.items()))
    return summary
