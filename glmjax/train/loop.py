"""The training loop of every LM stage: data -> model -> jitted steps -> checkpoints and metrics.

`run(config, workdir)` runs one stage, or (stage="recipe") the recipe's stages in order, each in workdir/<stage>
and initialised from the one before (train.py reaches it through glmjax.launch). `train(config, workdir)` runs one
stage and survives interruptions: it resumes from the newest readable checkpoint of workdir (model, optimizer, data
iterator, step), so a run killed at any point and started again continues with bitwise the same batches and losses.
SIGTERM (and SIGINT) finish the current step, write a checkpoint and return. A non-finite loss never reaches the
weights or a checkpoint: the step is skipped (nan_policy="skip") or the run stops with diagnostics ("stop").

A stage's run is `refuse_changed_config` (a resume with another config stops before anything is built), `setup`
(mesh, data, optimizer, `build_steps` -- the train step starts compiling in a thread -- then the sharded model),
`restore` (checkpoint, or init_from), then `iterate`: `one_step` per step with the hooks of glmjax/train/hooks.py
(metrics records, eval, checkpoints / signals), and `finish` (summary).

Outputs in workdir: config.json, metrics.jsonl (appended across restarts; a resumed run re-logs the steps after
its checkpoint), tb/ (TensorBoard), checkpoints/, summary.json (written when the stage completes).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ConfigError, ModelConfig
from glmjax.data import default_data_config, make_pipeline, validate_data_config
from glmjax.data.read_ahead import Interrupted
from glmjax.flops import flops_per_token
from glmjax.hardware import chip_of_device
from glmjax.model import mla_paths
from glmjax.model.transformer import GLM, Batch
from glmjax.optim import validate_optim_config
from glmjax.parallel import (abstract, batch_sharding, global_batch, init_opt_state, make_mesh, num_batch_shards,
                             opt_state_shardings, process_rows, sharded_init, shardings_of)
from glmjax.resolve import locate
from glmjax.train.checkpoint import Checkpoints, intact_steps, newest_meta
from glmjax.train.config import stage_config, validate_recipe, validate_stage, validate_train_config
from glmjax.train.hooks import CheckpointHook, EvalHook, MetricsLog, due, stop_signals
from glmjax.train.init_from import init_model
from glmjax.train.programs import load_or_compile
from glmjax.train.resume import ConfigMismatch, archive_run, check_resume, config_diff, fingerprint
from glmjax.train.stages import STAGES, TRAINABLE, Stage
from glmjax.train.step import count_params, make_eval_step, make_optimizer, make_train_step


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
    """One LM stage (config.stage) or the whole recipe (config.stage == "recipe") -> summary (per stage for a
    recipe). train.py reaches it through glmjax.launch.run (which also starts multi-host JAX and runs PPO)."""
    if config.stage != "recipe":
        return train(stage_config(config, config.stage), workdir, progress)
    validate_recipe(config)
    for i, name in enumerate(config.recipe):  # every stage's config is checked before anything runs
        c = stage_config(config, name)
        c.init_from = config.init_from if i == 0 else os.path.join(workdir, config.recipe[i - 1])
        check_config(c, init_exists=i == 0)
    summaries, init = {}, config.init_from
    with stop_signals() as stop:  # train.py's (launch.run): a signal at a stage's last step stops the recipe there
        for name in config.recipe:
            if stop["signal"]:
                print(f"{stop['signal']}: stopping before stage {name}; the same command resumes")
                break
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
    context = config.parallel.get("context", 1) if "parallel" in config else 1
    pieces = context * (2 if cfg.context_layout == "zigzag" else 1) if isinstance(context, int) else 1
    if pieces > 1 and config.train.seq_len % pieces:
        raise ConfigError(f"train.seq_len={config.train.seq_len}: must be a multiple of {pieces} (parallel.context="
                          f"{context}, model.context_layout={cfg.context_layout!r}: each context shard holds "
                          f"{pieces // context} equal chunk(s) of the sequence)")
    if init_exists and config.init_from:
        try:
            locate(config.init_from, "init_from")
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
    return cfg, data_cfg, stage


def refuse_changed_config(config, workdir: str):
    """`restore`'s refusal of a changed config (train.on_config_change="error") before anything is built: raises
    ConfigMismatch if the newest checkpoint whose meta reads was written with another config. (Damaged steps, and
    archiving the old run under "fresh" / "weights", are `restore`'s.)"""
    found = newest_meta(workdir) if config.train.on_config_change == "error" else None
    if found is not None:
        step, meta = found
        check_resume(meta, step, fingerprint(config), os.path.join(os.path.abspath(workdir), "checkpoints"))


def prepare_workdir(workdir: str, config, on_config_change: str | None = None) -> dict | None:
    """Create workdir and check it is writable -> the finished stage's summary if summary.json exists (and the
    config matches the one it finished with), else None (config.json written). on_config_change: the config's rule
    (default train.on_config_change; the PPO stage passes ppo.on_config_change)."""
    on_config_change = on_config_change or config.train.on_config_change
    try:
        os.makedirs(workdir, exist_ok=True)
        done = os.path.join(workdir, "summary.json")
        if os.path.exists(done):
            saved = os.path.join(workdir, "config.json")
            diff = config_diff(fingerprint(json.load(open(saved))), fingerprint(config)) \
                if os.path.exists(saved) else []
            if not diff or on_config_change == "error":
                if diff:
                    how = ("--config.ppo.on_config_change=fresh" if "ppo" in config else
                           "--config.train.on_config_change=fresh or =weights")
                    raise ConfigMismatch(f"workdir {workdir}: the stage finished with a different config "
                                         f"({'; '.join(diff)}). Use a new --workdir, or add {how} to start over "
                                         "here")
                print(f"stage {config.get('stage', 'ppo')}: already complete ({done})")
                with open(done) as f:
                    return json.load(f)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
    except OSError as e:
        raise ConfigError(f"workdir={workdir!r}: cannot be used as the output directory ({e.strerror or e})") from e
    return None


@dataclasses.dataclass
class StageRun:
    """One stage's run: what `setup` builds, the state `restore` and every step replace, the jitted steps
    (`build_steps`; `train_step` is a `Background` compile until `train` takes its result) and the last step
    reached."""
    config: Any
    workdir: str
    cfg: ModelConfig
    stage: Stage
    mode: str
    mesh: Any
    data: Any  # the training pipeline; `it` is its (checkpointed) iterator
    it: Any
    eval_set: list
    graphdef: Any
    params: Any
    rest: Any
    opt_state: Any
    tx: Any
    groups: Any  # the optimizer's GroupTable (its learning-rate schedules are logged)
    ckpt: Checkpoints
    run_fp: dict  # the config's fingerprint (glmjax/train/resume.py), stored in every checkpoint
    n_train: int
    n_all: int
    start_step: int = 0
    step: int = 0
    train_step: Any = None
    eval_step: Any = None
    init: Any = None  # the jitted random initialiser of (params, rest); `initialise` runs it if nothing is resumed

    @property
    def trainable(self):
        return TRAINABLE[self.stage.trainable]

    def global_rows(self, b) -> Batch:
        """This process's rows -> one global, batch-sharded Batch."""
        return to_batch(global_batch(b, self.mesh, self.config.train.batch_size))

    def evaluate(self) -> dict:
        return evaluate(self.eval_step, self.params, self.rest, [self.global_rows(b) for b in self.eval_set])

    def save(self, step: int):
        meta = {"step": step, "stage": self.config.stage, "model": self.cfg.to_json_dict(),
                "fingerprint": self.run_fp}
        self.ckpt.save(step, nnx.merge_state(self.params, self.rest).to_pure_dict(), self.opt_state,
                       {"processes": all_processes(self.it.get_state())}, meta)


def train(config, workdir: str, progress: bool = True) -> dict:
    """Run (or resume) one stage in workdir -> summary dict."""
    t0 = time.perf_counter()
    cfg, data_cfg, stage = check_config(config)
    refuse_changed_config(config, workdir)  # before config.json is written: a refused run leaves the workdir as it was
    finished = prepare_workdir(workdir, config)
    if finished is not None:
        return finished
    with stop_signals() as stop:  # from here on SIGTERM / SIGINT stop the run cleanly, in set-up too
        run = setup(config, workdir, cfg, data_cfg, stage)
        try:
            restore(run)
            run.data.start(interrupt=lambda: stop["signal"])  # the first batch is prepared while the step compiles
            compiled = run.train_step.result()
        except BaseException:
            run.train_step.join()  # never leave a compile running behind an error (the step's own error: joined)
            run.ckpt.close()
            run.data.close()  # and no prefetch thread
            raise
        run.train_step = compiled
        if stop["signal"]:
            jax.block_until_ready((run.params, run.rest, run.opt_state))  # no computation left running at exit
            run.ckpt.close()
            run.data.close()
            raise Interrupted(f"{stop['signal']} during set-up, before step {run.start_step + 1}: nothing new to "
                              "checkpoint; the same command resumes")
        summary: dict = {"stage": config.stage, "params": run.n_all, "trainable_params": run.n_train,
                         "start_step": run.start_step, "setup_s": time.perf_counter() - t0, "skipped_steps": 0}
        records = iterate(run, summary, stop, progress, t0)
    return finish(run, summary, records, t0)


def setup(config, workdir: str, cfg: ModelConfig, data_cfg, stage: Stage) -> StageRun:
    """Mesh, data pipelines (train and eval), the optimizer and the steps (built from the state's shapes and
    shardings; the train step compiling from here on), the model's and optimizer's state as shapes and shardings
    (abstract: `restore` fills them) and the checkpoint manager of one stage; nothing restored yet."""
    t = config.train
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

    # one initialiser program per model, whatever the stage trains (the recipe's stages share its compilation)
    graphdef, init = sharded_init(lambda: GLM(cfg, nnx.Rngs(t.seed)), mesh)
    init_key = {"init": cfg.to_json_dict(), "seed": t.seed,  # the mesh: parallel.* (and the devices: programs.py)
                "parallel": {k: v for k, v in fingerprint(config).items() if k.startswith("parallel.")}}
    split = lambda state: nnx.split_state(state, TRAINABLE[stage.trainable], ...)  # noqa: E731 -> (params, rest)
    params, rest = split(jax.eval_shape(init)[0])  # shapes and shardings; the arrays: a checkpoint's, or `initialise`'s
    n_train, n_all = count_params(params), count_params(nnx.merge_state(params, rest).filter(nnx.Param))
    mode = stage.mode or t.mode
    print(f"stage {config.stage}: attention {mode}, trains {stage.trainable} ({n_train:,} of {n_all:,} params); "
          f"{t.batch_size}x{t.seq_len} tokens/step, {t.steps} steps")
    print("\n".join(mla_paths.describe(cfg, mode, t.batch_size, t.seq_len, mesh)))
    tx, groups = make_optimizer(params, config.optim, t.steps, cfg)
    print(groups)
    opt_state = abstract(jax.eval_shape(tx.init, params), opt_state_shardings(tx, params, mesh))
    run = StageRun(config, workdir, cfg, stage, mode, mesh, data, iter(data), eval_set, graphdef, params, rest,
                   opt_state, tx, groups, None, fingerprint(config), n_train, n_all,
                   init=lambda: split(load_or_compile(init, (), init_key)()[0]))
    build_steps(run)
    try:
        run.ckpt = Checkpoints(workdir, t.keep_checkpoints, t.async_checkpoints)
    except BaseException:
        run.train_step.join()  # never leave a compile running behind an error
        raise
    return run


def initialise(run: StageRun):
    """Create the fresh model and optimizer state (random init, in their shardings) in place of the abstract ones;
    a resumed run never does this: its checkpoint's arrays are read straight into the shardings."""
    run.params, run.rest = run.init()
    run.opt_state = init_opt_state(run.tx, run.params, run.mesh)


def restore(run: StageRun):
    """Resume from the newest readable checkpoint of the workdir (model, optimizer, data iterator, step), or, with
    none, create the fresh state (`initialise`) and load config.init_from's weights into it. The checkpoints of a
    changed config are an error or are archived first (train.on_config_change; "weights" then initialises from the
    archived run)."""
    t, init_path = run.config.train, run.config.init_from
    try:
        restored = run.ckpt.restore_latest(nnx.merge_state(run.params, run.rest).to_pure_dict(), run.opt_state,
                                           lambda meta, step: check_resume(meta, step, run.run_fp,
                                                                           run.ckpt.directory))
    except ConfigMismatch as e:
        run.ckpt.close()
        if t.on_config_change == "error":
            raise
        old = archive_run(run.workdir)
        print(f"train.on_config_change={t.on_config_change!r}: {e}\n-> the old run was moved to {old}; starting "
              f"at step 0" + (" from its model weights" if t.on_config_change == "weights" else ""))
        if t.on_config_change == "weights":
            init_path = old
        restored, run.ckpt = None, Checkpoints(run.workdir, t.keep_checkpoints, t.async_checkpoints)
    if restored:
        resume_from(run, restored)
        return
    initialise(run)
    if init_path:
        init_weights(run, init_path)


def resume_from(run: StageRun, restored: tuple):
    """Put a restored checkpoint (step, model state, optimizer state, data state, meta) into `run`."""
    run.start_step, model_state, run.opt_state, data_state, meta = restored
    run.step = run.start_step
    state = nnx.merge_state(run.params, run.rest)
    nnx.replace_by_pure_dict(state, model_state)
    _, run.params, run.rest = nnx.split(nnx.merge(run.graphdef, state), run.trainable, ...)
    nproc = jax.process_count()
    if len(data_state["processes"]) != nproc:
        raise ConfigError(f"checkpoint {run.ckpt.directory}/{run.start_step} was written by "
                          f"{len(data_state['processes'])} processes; resuming needs the same count, not {nproc}")
    run.it.set_state(data_state["processes"][jax.process_index()])
    print(f"resumed from {run.ckpt.directory}/{run.start_step} (stage {meta.get('stage')})")


def init_weights(run: StageRun, path: str):
    """Overwrite the fresh model's weights from `path` (see `init_model`), keeping their shardings."""
    shardings = (shardings_of(run.params), shardings_of(run.rest))
    model = nnx.merge(run.graphdef, run.params, run.rest)
    for line in init_model(model, path):
        print(f"init_from {path}: {line}")
    _, new_params, new_rest = nnx.split(model, run.trainable, ...)
    run.params, run.rest = jax.device_put((new_params, new_rest), shardings)


# config fields that never reach the train step: a rerun that changes only these finds its compiled step
LOOP_ONLY = ("init_from", "data.", "train.log_every", "train.eval_every", "train.eval_batches",
             "train.checkpoint_every", "train.keep_checkpoints", "train.async_checkpoints", "train.tensorboard")


def build_steps(run: StageRun):
    """The stage's jitted train and eval steps, sharded like the state (`run`'s abstract state: shapes and
    shardings). The train step starts compiling at once, in a thread (`run.train_step` is then a `Background`
    whose result is the compiled step): tracing, lowering and compiling it -- or fetching it from the compilation
    cache -- overlap creating the model, the optimizer state and the restore. Its first call then neither traces
    nor compiles."""
    t = run.config.train
    step = make_train_step(run.graphdef, run.tx, run.stage, run.mode, t.bias_update_rate, t.index_loss_weight,
                           t.inject_nan_at_step, mesh=run.mesh, state=(run.params, run.rest, run.opt_state))
    tokens = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=batch_sharding(run.mesh))
    args = (run.params, run.rest, run.opt_state, Batch(tokens, tokens, tokens, tokens),
            jax.ShapeDtypeStruct((), jnp.int32))

    run.eval_step = make_eval_step(run.graphdef, run.stage, run.mode, mesh=run.mesh, state=(run.params, run.rest))

    key = {k: v for k, v in run.run_fp.items() if not k.startswith(LOOP_ONLY)}
    compile_step = lambda: load_or_compile(step, args, key)  # noqa: E731 -> the compiled step

    run.train_step = Background(compile_step)  # last: nothing here raises with the thread running


class Background(threading.Thread):
    """fn() run in a thread from construction on; `result()` waits for it and returns its value or raises its
    error (in the caller's thread)."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised by result()
            self.error = e

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def iterate(run: StageRun, summary: dict, stop: dict, progress: bool, t0: float) -> StepRecords:
    """The step loop with its hooks (records, eval, checkpoints) from run.start_step to train.steps, or until a
    caught signal; the checkpoint manager is closed (asynchronous saves waited for) whatever happens. A full disk
    raises DiskFull naming the last intact checkpoint."""
    t, pid = run.config.train, jax.process_index()
    failure = None
    try:
        with MetricsLog(os.path.join(run.workdir, "metrics.jsonl") if pid == 0 else os.devnull, "a",
                        os.path.join(run.workdir, "tb") if t.tensorboard and pid == 0 else None, total=t.steps,
                        initial=run.start_step, disable=not progress or pid != 0, desc=run.config.stage) as log:
            records = StepRecords(run, log, summary, t0)
            evals = EvalHook(run.evaluate, t.eval_every, t.steps, log, summary, eval_line) if run.eval_set else None
            checkpoints = CheckpointHook(run.save, t.checkpoint_every, t.steps, stop, log)
            for step in range(run.start_step + 1, t.steps + 1):
                run.step = step
                try:
                    m = one_step(run, step, records, log, summary)
                except Interrupted as e:  # while waiting for the data thread: step - 1 was the last one trained
                    summary["interrupted"] = interrupted_between_steps(run, step - 1, str(e), log)
                    break
                log.bar.update(1)
                records(step, m)
                if evals:
                    records.pause(evals(step))  # eval time is not training throughput
                signame = checkpoints(step)
                if signame:
                    summary["interrupted"] = signame
                    break
    except Exception as e:  # noqa: BLE001 -- re-raised below, after the checkpoints are closed
        failure = e
    finally:
        try:
            run.ckpt.close()  # first: a preempted run's checkpoint before anything else
        except Exception as e:  # noqa: BLE001 -- an asynchronous save that failed reports here
            failure = failure or e
        run.data.close()  # the read-ahead thread ends here, not at interpreter exit (glmjax/data/read_ahead.py)
    if failure is not None:
        if disk_full(failure):
            good = intact_steps(run.ckpt.directory)
            raise DiskFull(f"no space left on the device of {run.workdir} at step {run.step}; the last intact "
                           f"checkpoint is " + (f"step {good[-1]} ({run.ckpt.step_dir(good[-1])})" if good else "none")
                           + ". Free space and rerun the same command to resume") from failure
        raise failure
    return records


def interrupted_between_steps(run: StageRun, done: int, signame: str, log: MetricsLog) -> str:
    """A signal caught while the next batch was not ready: checkpoint step `done` (unless it was just saved, or
    nothing was trained) and say so -> the signal's name."""
    t = run.config.train
    run.step = done
    if done <= run.start_step:
        log.message(f"{signame}: the next batch was not ready; no step trained since step {done}; stopping")
        return signame
    if not due(done, t.checkpoint_every, t.steps):
        run.save(done)
    log.message(f"{signame}: the next batch was not ready; checkpoint at step {done}; stopping")
    return signame


def one_step(run: StageRun, step: int, records: StepRecords, log: MetricsLog, summary: dict) -> dict:
    """Train step `step` on the next batch -> its metrics (on device). A skipped step (non-finite loss or gradient:
    nothing was applied) is logged, and stops the run under train.nan_policy="stop"."""
    b = next(run.it)
    run.params, run.rest, run.opt_state, m = run.train_step(run.params, run.rest, run.opt_state, run.global_rows(b),
                                                            jnp.int32(step))
    records.count(int(np.sum(b["segment_ids"] > 0)) * jax.process_count())
    if int(m["skipped"]):
        summary["skipped_steps"] += 1
        bad = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
        log.write({"step": step, "skipped": 1, **{f"bad_{k}": v for k, v in bad.items() if np.isfinite(v)}})
        msg = (f"step {step}: non-finite loss/gradient (loss {bad['loss']}, grad_norm {bad['grad_norm']}); the "
               "update was not applied")
        log.message(msg)
        if run.config.train.nan_policy == "stop":
            raise FloatingPointError(msg + f"; stopping (train.nan_policy='stop'). The last good checkpoint is step "
                                           f"{max(run.ckpt.steps(), default=None)}")
    return m


def eval_line(step: int, e: dict, step_metrics) -> str:
    return f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items())


class StepRecords:
    """The training records of the LM loop (a metrics hook): at the first step, every train.log_every steps and at
    the last, the step's scalar metrics, the learning rates, tokens/s since the previous record and MFU, written to
    the metrics log and the progress bar. The first step (compilation) and evaluations (`pause`) are left out of
    the throughput."""

    def __init__(self, run: StageRun, log: MetricsLog, summary: dict, t0: float):
        self.run, self.log, self.summary, self.t0 = run, log, summary, t0
        self.window_t, self.window_tokens, self.timed_tokens, self.timed_s = time.perf_counter(), 0, 0, 0.0
        flops_mode = "dense" if run.mode == "dense" else "dsa_indexshare"
        self.train_flops = flops_per_token(run.cfg, run.config.train.seq_len, "training", flops_mode)["total"]
        chip = chip_of_device(jax.devices()[0])
        self.peak = chip.peak_bf16_flops * run.mesh.size if chip else None

    def count(self, tokens: int):
        self.window_tokens += tokens

    def pause(self, seconds: float):
        self.window_t += seconds

    @property
    def tokens_per_s(self) -> float | None:
        """Over the timed steps; None: no timed step (e.g. resumed at the end)."""
        return self.timed_tokens / self.timed_s if self.timed_s else None

    def __call__(self, step: int, m: dict):
        run, first = self.run, self.run.start_step + 1
        if not (step == first or due(step, run.config.train.log_every, run.config.train.steps)):
            return
        m = jax.device_get(m)
        now = time.perf_counter()
        if step > first:  # the first step compiles: not counted in tokens/s
            self.timed_tokens, self.timed_s = self.timed_tokens + self.window_tokens, self.timed_s + now - self.window_t
        else:
            self.summary["first_step_s"], self.summary["first_loss"] = now - self.t0, float(m["loss"])
        tps = self.window_tokens / max(now - self.window_t, 1e-9)
        record = {"step": step, **{k: float(v) for k, v in m.items() if np.ndim(v) == 0},
                  **{f"lr_{g}": float(s(step - 1)) for g, s in run.groups.schedules.items()},
                  "tokens_per_s": tps, "wall_s": now - self.t0}
        if self.peak and step > first:
            record["mfu"] = tps * self.train_flops / self.peak
        self.log.write(record)
        self.log.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}",
                                 mfu=f"{record['mfu']:.1%}" if "mfu" in record else "n/a")
        self.summary["last_loss"] = record["loss"]
        self.window_t, self.window_tokens = time.perf_counter(), 0


def finish(run: StageRun, summary: dict, records: StepRecords, t0: float) -> dict:
    """Complete the summary (a stage that ran to the end also gets its final eval and summary.json) and print it."""
    summary["step"] = run.step
    summary["tokens_per_s"] = records.tokens_per_s
    if not summary.get("interrupted"):
        if "last_loss" not in summary:  # resumed at the last checkpoint: nothing trained in this process
            summary["last_loss"] = last_logged_loss(os.path.join(run.workdir, "metrics.jsonl"), run.step)
        if run.eval_set and "eval_loss" not in summary:
            summary.update(run.evaluate())
    summary["data"] = run.data.totals
    summary["wall_s"] = time.perf_counter() - t0
    if not summary.get("interrupted") and jax.process_index() == 0:
        with open(os.path.join(run.workdir, "summary.json"), "w") as f:
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
