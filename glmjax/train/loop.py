"""The training loop of every stage: data -> model -> jitted steps -> checkpoints and metrics.

`run(config, workdir)` is train.py's entry point: one stage, or (stage="recipe") the recipe's stages in order,
each in workdir/<stage> and initialised from the one before. `train(config, workdir)` runs one stage and survives
interruptions: it resumes from the newest readable checkpoint of workdir (model, optimizer, data iterator, step),
so a run killed at any point and started again continues with bitwise the same batches and losses. SIGTERM (and
SIGINT) finish the current step, write a checkpoint and return. A non-finite loss never reaches the weights or a
checkpoint: the step is skipped (nan_policy="skip") or the run stops with diagnostics ("stop").

Outputs in workdir: config.json, metrics.jsonl (appended across restarts; a resumed run re-logs the steps after
its checkpoint), tb/ (TensorBoard), checkpoints/, summary.json (written when the stage completes).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from glmjax.config import ConfigError, ModelConfig
from glmjax.data import default_data_config, make_pipeline, validate_data_config
from glmjax.flops import flops_per_token
from glmjax.interop.keymap import model_config_json
from glmjax.model.transformer import GLM, Batch
from glmjax.optim import validate_optim_config
from glmjax.train.checkpoint import Checkpoints, intact_steps, load_model_state
from glmjax.train.resume import ConfigMismatch, archive_run, check_resume, config_diff, fingerprint
from glmjax.train.config import stage_config, validate_recipe, validate_stage, validate_train_config
from glmjax.parallel import (batch_sharding, create_sharded, global_batch, init_opt_state, initialize_distributed,
                             make_mesh, num_batch_shards, process_rows, shardings_of)
from glmjax.train.stages import STAGES, TRAINABLE, surgery
from glmjax.train.step import count_params, make_eval_step, make_optimizer, make_train_step

# Peak dense bf16 FLOP/s per chip, by jax device_kind prefix (for MFU). Unknown chips and CPUs report "n/a".
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
              "TPU v6 lite": 918e12, "TPU v6e": 918e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12,
              "NVIDIA A100": 312e12}


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])) if kind.startswith(k)), None)


def to_batch(b: dict) -> Batch:
    return Batch(jnp.asarray(b["tokens"]), jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"]),
                 jnp.asarray(b["loss_mask"]) if "loss_mask" in b else None)


def evaluate(eval_step, params, rest, batches) -> dict:
    """Token-mean LM loss over all eval batches (exact: sums of NLL / counts), plus means of the other metrics.
    batches: Batch tuples or dicts of arrays."""
    outs = [jax.device_get(eval_step(params, rest, b if isinstance(b, Batch) else to_batch(b))) for b in batches]
    m = {"eval_loss": float(sum(o["lm_nll_sum"] for o in outs) / max(sum(o["lm_tokens"] for o in outs), 1.0))}
    for k in outs[0]:
        if k not in ("lm_nll_sum", "lm_tokens"):
            m[f"eval_{k}"] = float(np.mean([o[k] for o in outs]))
    return m


def run(config, workdir: str, progress: bool = True) -> dict:
    """One stage (config.stage) or the whole recipe (config.stage == "recipe") -> summary (per stage for a recipe).
    Starts multi-host JAX first when config.parallel / the environment asks for it (glmjax.parallel.mesh)."""
    initialize_distributed(config.parallel if "parallel" in config else None)
    if config.stage == "ppo":  # post-training: glmjax/rl (its own loop: rollouts, critic, GAE)
        from glmjax.rl.ppo import train_ppo

        return train_ppo(config, workdir, progress, load_params=checkpoint_loader(ModelConfig.from_dict(config.model)))
    if config.stage != "recipe":
        return train(stage_config(config, config.stage), workdir, progress)
    validate_recipe(config)
    for i, name in enumerate(config.recipe):  # every stage's config is checked before anything runs
        c = stage_config(config, name)
        c.init_from = config.init_from if i == 0 else os.path.join(workdir, config.recipe[i - 1])
        check_config(c, init_exists=i == 0)
    summaries, init = {}, config.init_from
    for name in config.recipe:
        c = stage_config(config, name)
        c.init_from = init
        print(f"\n=== stage {name} -> {os.path.join(workdir, name)} ===")
        summaries[name] = train(c, os.path.join(workdir, name), progress)
        if summaries[name].get("interrupted"):
            break
        init = os.path.join(workdir, name)
    return summaries


def check_config(config, init_exists: bool = True):
    """Validate a single-stage config up front (nothing is built) -> (ModelConfig, data section, Stage)."""
    stage = STAGES.get(config.stage)
    if stage is None:
        raise ConfigError(f"stage={config.stage!r}: must be one of {sorted(STAGES)} (or 'recipe')")
    cfg = ModelConfig.from_dict(config.model)
    data_cfg = config.data if "data" in config else default_data_config()
    validate_data_config(data_cfg)
    validate_train_config(config.train, cfg)
    validate_stage(config, cfg)
    validate_optim_config({**config.optim.to_dict(), "total_steps": config.train.steps})
    if init_exists and config.init_from:
        if not os.path.exists(config.init_from):
            raise ConfigError(f"init_from={config.init_from!r}: no such directory")
        if not any(os.path.exists(os.path.join(config.init_from, n)) for n in INIT_MARKERS):
            raise ConfigError(f"init_from={config.init_from!r}: neither a stage workdir (checkpoints/), an imported "
                              "checkpoint (model_config.json) nor a Hugging Face checkpoint (config.json)")
    return cfg, data_cfg, stage


INIT_MARKERS = ("checkpoints", "model_config.json", "config.json")


def prepare_workdir(workdir: str, config) -> dict | None:
    """Create workdir and check it is writable -> the finished stage's summary if summary.json exists (and the
    config matches the one it finished with), else None (config.json written)."""
    try:
        os.makedirs(workdir, exist_ok=True)
        done = os.path.join(workdir, "summary.json")
        if os.path.exists(done):
            saved = os.path.join(workdir, "config.json")
            diff = config_diff(fingerprint(json.load(open(saved))), fingerprint(config)) \
                if os.path.exists(saved) else []
            if not diff or config.train.on_config_change == "error":
                if diff:
                    raise ConfigMismatch(f"workdir {workdir}: the stage finished with a different config "
                                         f"({'; '.join(diff)}). Use a new --workdir, or add "
                                         "--config.train.on_config_change=fresh or =weights to start over here")
                print(f"stage {config.stage}: already complete ({done})")
                with open(done) as f:
                    return json.load(f)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
    except OSError as e:
        raise ConfigError(f"workdir={workdir!r}: cannot be used as the output directory ({e.strerror or e})") from e
    return None


def train(config, workdir: str, progress: bool = True) -> dict:
    """Run (or resume) one stage in workdir -> summary dict."""
    t0 = time.perf_counter()
    t = config.train
    cfg, data_cfg, stage = check_config(config)
    mode = stage.mode or t.mode
    finished = prepare_workdir(workdir, config)
    if finished is not None:
        return finished
    done = os.path.join(workdir, "summary.json")

    mesh = make_mesh(config.parallel if "parallel" in config else None)
    pid, nproc = jax.process_index(), jax.process_count()
    share = t.batch_size // nproc
    if t.batch_size % num_batch_shards(mesh) or t.batch_size % nproc or not np.array_equal(
            process_rows(batch_sharding(mesh), t.batch_size), np.arange(pid * share, (pid + 1) * share)):
        raise ConfigError(f"train.batch_size={t.batch_size}: must split evenly over the mesh's "
                          f"{num_batch_shards(mesh)} batch shards ({dict(mesh.shape)}) and the {nproc} processes")
    data = make_pipeline(data_cfg, t.seq_len, t.batch_size, t.seed, "train", pid, nproc)
    eval_data = make_pipeline(data_cfg, t.seq_len, t.batch_size, t.seed, "eval", pid, nproc) \
        if t.eval_batches else None
    eval_set = eval_data.take(t.eval_batches) if eval_data else []
    if cfg.vocab_size < data.tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size}: must be >= the tokenizer's {data.tokenizer.vocab_size}")
    print(f"data: {data!r}; {len(eval_set)} eval batches; mesh {dict(mesh.shape)}, {nproc} process(es)")

    def global_rows(b):  # this process's rows -> one global, batch-sharded Batch
        return to_batch(global_batch(b, mesh, t.batch_size))

    trainable = TRAINABLE[stage.trainable]
    graphdef, params, rest = create_sharded(lambda: GLM(cfg, nnx.Rngs(t.seed)), mesh, trainable, ...)
    shardings = (shardings_of(params), shardings_of(rest))  # before surgery writes host arrays into them
    n_train, n_all = count_params(params), count_params(nnx.merge_state(params, rest).filter(nnx.Param))
    print(f"stage {config.stage}: attention {mode}, trains {stage.trainable} ({n_train:,} of {n_all:,} params); "
          f"{t.batch_size}x{t.seq_len} tokens/step, {t.steps} steps")
    tx, groups = make_optimizer(params, config.optim, t.steps, cfg)
    print(groups)
    opt_state = init_opt_state(tx, params, mesh)

    start_step, it, init_path = 0, iter(data), config.init_from
    run_fp = fingerprint(config)
    ckpt = Checkpoints(workdir, t.keep_checkpoints, t.async_checkpoints)
    try:
        restored = ckpt.restore_latest(nnx.merge_state(params, rest).to_pure_dict(), opt_state,
                                       lambda meta, step: check_resume(meta, step, run_fp, ckpt.directory))
    except ConfigMismatch as e:
        ckpt.close()
        if t.on_config_change == "error":
            raise
        old = archive_run(workdir)
        print(f"train.on_config_change={t.on_config_change!r}: {e}\n-> the old run was moved to {old}; starting "
              f"at step 0" + (" from its model weights" if t.on_config_change == "weights" else ""))
        if t.on_config_change == "weights":
            init_path = old
        restored, ckpt = None, Checkpoints(workdir, t.keep_checkpoints, t.async_checkpoints)
    except BaseException:
        ckpt.close()
        raise
    if not restored and init_path:
        model = nnx.merge(graphdef, params, rest)
        for line in init_model(model, init_path):
            print(f"init_from {init_path}: {line}")
        _, new_params, new_rest = nnx.split(model, trainable, ...)
        params, rest = jax.device_put((new_params, new_rest), shardings)
        del model
    if restored:
        start_step, model_state, opt_state, data_state, meta = restored
        state = nnx.merge_state(params, rest)
        nnx.replace_by_pure_dict(state, model_state)
        _, params, rest = nnx.split(nnx.merge(graphdef, state), trainable, ...)
        if len(data_state["processes"]) != nproc:
            raise ConfigError(f"checkpoint {ckpt.directory}/{start_step} was written by "
                              f"{len(data_state['processes'])} processes; resuming needs the same count, not {nproc}")
        it.set_state(data_state["processes"][pid])
        print(f"resumed from {ckpt.directory}/{start_step} (stage {meta.get('stage')})")

    train_step = make_train_step(graphdef, tx, stage, mode, t.bias_update_rate, t.index_loss_weight,
                                 t.inject_nan_at_step, mesh=mesh, state=(params, rest, opt_state))
    eval_step = make_eval_step(graphdef, stage, mode, mesh=mesh, state=(params, rest))
    flops_mode = "dense" if mode == "dense" else "dsa_indexshare"
    train_flops = flops_per_token(cfg, t.seq_len, "training", flops_mode)["total"]
    peak = peak_flops(jax.devices()[0])
    peak = peak * mesh.size if peak else None

    def save(step):
        meta = {"step": step, "stage": config.stage, "model": model_config_json(cfg), "fingerprint": run_fp}
        ckpt.save(step, nnx.merge_state(params, rest).to_pure_dict(), opt_state,
                  {"processes": all_processes(it.get_state())}, meta)

    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signal.Signals(signum).name

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    writer = tensorboard_writer(workdir) if t.tensorboard and pid == 0 else None
    summary: dict = {"stage": config.stage, "params": n_all, "trainable_params": n_train, "start_step": start_step,
                     "setup_s": time.perf_counter() - t0, "skipped_steps": 0}
    window_t, window_tokens, timed_tokens, timed_s = time.perf_counter(), 0, 0, 0.0
    step, failure = start_step, None
    try:
        with open(os.path.join(workdir, "metrics.jsonl") if pid == 0 else os.devnull, "a") as out, \
                tqdm(total=t.steps, initial=start_step, disable=not progress or pid != 0, dynamic_ncols=True,
                     desc=config.stage) as bar:
            def write(record):
                out.write(json.dumps(record) + "\n")
                out.flush()
                if writer:
                    for k, v in record.items():
                        if k != "step":
                            writer.add_scalar(k, v, record["step"])

            for step in range(start_step + 1, t.steps + 1):
                b = next(it)
                params, rest, opt_state, m = train_step(params, rest, opt_state, global_rows(b), jnp.int32(step))
                window_tokens += int(np.sum(b["segment_ids"] > 0)) * nproc
                if int(m["skipped"]):
                    summary["skipped_steps"] += 1
                    bad = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
                    write({"step": step, "skipped": 1, **{f"bad_{k}": v for k, v in bad.items()
                                                          if np.isfinite(v)}})
                    msg = (f"step {step}: non-finite loss/gradient (loss {bad['loss']}, grad_norm "
                           f"{bad['grad_norm']}); the update was not applied")
                    bar.write(msg)
                    if t.nan_policy == "stop":
                        raise FloatingPointError(msg + f"; stopping (train.nan_policy='stop'). The last good "
                                                       f"checkpoint is step {max(ckpt.steps(), default=None)}")
                bar.update(1)
                if step == start_step + 1 or step % t.log_every == 0 or step == t.steps:
                    m = jax.device_get(m)
                    now = time.perf_counter()
                    if step > start_step + 1:  # the first step compiles: not counted in tokens/s
                        timed_tokens, timed_s = timed_tokens + window_tokens, timed_s + now - window_t
                    else:
                        summary["first_step_s"], summary["first_loss"] = now - t0, float(m["loss"])
                    tps = window_tokens / max(now - window_t, 1e-9)
                    record = {"step": step, **{k: float(v) for k, v in m.items() if np.ndim(v) == 0},
                              **{f"lr_{g}": float(s(step - 1)) for g, s in groups.schedules.items()},
                              "tokens_per_s": tps, "wall_s": now - t0}
                    if peak and step > start_step + 1:
                        record["mfu"] = tps * train_flops / peak
                    write(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}",
                                    mfu=f"{record['mfu']:.1%}" if "mfu" in record else "n/a")
                    summary["last_loss"] = record["loss"]
                    window_t, window_tokens = time.perf_counter(), 0
                if eval_set and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
                    e0 = time.perf_counter()
                    e = evaluate(eval_step, params, rest, [global_rows(b) for b in eval_set])
                    write({"step": step, **e})
                    bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items()))
                    summary.update(e)
                    window_t += time.perf_counter() - e0  # eval time is not training throughput
                if step % t.checkpoint_every == 0 or step == t.steps:
                    save(step)
                if stop["signal"] and step < t.steps:  # at the last step the stage is complete
                    if step % t.checkpoint_every and step != t.steps:
                        save(step)
                    bar.write(f"{stop['signal']}: checkpoint written at step {step}; stopping")
                    summary["interrupted"] = stop["signal"]
                    break
    except Exception as e:  # noqa: BLE001 -- re-raised below, after the checkpoints are closed
        failure = e
    finally:
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 -- an asynchronous save that failed reports here
            failure = failure or e
        if writer:
            writer.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if failure is not None:
        if disk_full(failure):
            good = intact_steps(ckpt.directory)
            raise DiskFull(f"no space left on the device of {workdir} at step {step}; the last intact checkpoint "
                           f"is " + (f"step {good[-1]} ({ckpt.step_dir(good[-1])})" if good else "none")
                           + ". Free space and rerun the same command to resume") from failure
        raise failure
    summary["step"] = step
    summary["tokens_per_s"] = timed_tokens / timed_s if timed_s else None  # None: no timed step (resumed at the end)
    if not summary.get("interrupted"):
        if "last_loss" not in summary:  # resumed at the last checkpoint: nothing trained in this process
            summary["last_loss"] = last_logged_loss(os.path.join(workdir, "metrics.jsonl"), step)
        if eval_set and "eval_loss" not in summary:
            summary.update(evaluate(eval_step, params, rest, [global_rows(b) for b in eval_set]))
    summary["data"] = data.stats
    summary["wall_s"] = time.perf_counter() - t0
    if not summary.get("interrupted") and pid == 0:
        with open(done, "w") as f:
            json.dump(summary, f, indent=2, default=float)
    print("done: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()
                               if not isinstance(v, dict)))
    return summary


class DiskFull(RuntimeError):
    """The disk filled up: the run stopped; the message names the last intact checkpoint."""


def disk_full(e: BaseException | None) -> bool:
    """Whether `e` or an exception it was raised from is ENOSPC (orbax wraps the errors of asynchronous saves)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def loss_records(path: str) -> tuple[list[tuple[int, float]], int]:
    """(step, loss) of every loss record of a metrics.jsonl, in file order, and the number of unreadable lines."""
    out, bad = [], 0
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if "loss" in r:
                    out.append((r["step"], r["loss"]))
    return out, bad


def last_logged_loss(path: str, step: int) -> float | None:
    """The loss logged for the newest step <= `step` in metrics.jsonl (None if there is none)."""
    best = (0, None)
    for s, loss in loss_records(path)[0]:
        if best[0] <= s <= step:
            best = (s, loss)
    return best[1]


def all_processes(state: dict) -> list[dict]:
    """Every process's (JSON-able) data-iterator state, in process order, on every process."""
    if jax.process_count() == 1:
        return [state]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([raw.size]))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[:raw.size] = raw
    everyone = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:int(n)]).decode()) for row, n in zip(everyone, np.ravel(sizes))]


def init_model(model: GLM, path: str) -> list[str]:
    """Initialise `model` in place from `path`: a stage workdir (orbax checkpoints/), a directory written by
    `python -m glmjax.interop.hf import`, or a Hugging Face safetensors checkpoint. -> log lines."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        state, meta, step = load_model_state(path)
        src_cfg = ModelConfig.from_dict(meta["model"])
        where = f"stage {meta.get('stage')} step {step}"
    elif os.path.exists(os.path.join(path, "model_config.json")) or os.path.exists(os.path.join(path, "config.json")):
        from glmjax.interop.hf import load_checkpoint, load_hf

        src = load_checkpoint(path)[0] if os.path.exists(os.path.join(path, "model_config.json")) else load_hf(path)[0]
        state, src_cfg, where = nnx.state(src).to_pure_dict(), src.cfg, "imported weights"
    else:
        raise FileNotFoundError(f"init_from={path!r}: neither a stage workdir (checkpoints/), an imported "
                                "checkpoint (model_config.json) nor a Hugging Face checkpoint (config.json)")
    return [where] + surgery(model, state, src_cfg)


def checkpoint_loader(cfg: ModelConfig):
    """-> load(path, target_state) -> state: `target_state` (a GLM of `cfg`) overwritten from `path` (see
    `init_model`: a stage workdir, an imported or a Hugging Face checkpoint), for the PPO stage's init_checkpoint."""
    def load(path: str, target_state):
        model = GLM(cfg, nnx.Rngs(0))
        nnx.update(model, target_state)
        for line in init_model(model, path):
            print(f"init_checkpoint {path}: {line}")
        return nnx.state(model)

    return load


def tensorboard_writer(workdir: str):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: JSONL metrics are always written
        print("tensorboardX is not installed: TensorBoard logs off", file=sys.stderr)
        return None
    return SummaryWriter(os.path.join(workdir, "tb"))
