"""Sharded training recipe shared by test_parallel.py and test_multihost.py, and the multi-host worker.

As a script it is one process of a multi-process run (tests/test_multihost.py starts two):
    python tests/sharded_training.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR OUT_JSON
It trains STEPS_BEFORE steps with the trainer's sharded step, checkpoints with orbax from every process, restores into
fresh arrays, checks them, trains STEPS_AFTER more steps and (process 0) writes the per-step losses as JSON; then it
runs the MULTIHOST_GROUPS stages' loss and gradients with context parallelism on CONTEXT_MESH, whose context shards
lie on both processes, and (process 0) writes them next to the JSON (`context_npz`); then decodes on that mesh
(`decode_npz`); last, both claim workdirs (`check_claims`).
"""
import json
import os
import sys

import numpy as np

SEQ, BATCH = 32, 8
STEPS_BEFORE, STEPS_AFTER = 5, 3
MULTIHOST_MESH = dict(data=2, fsdp=2, expert=2, tensor=1)  # 8 devices over 2 processes, expert parallel


def small_cfg(**kw):
    """Tiny shapes, 2 layers (one dense with an indexer, one MoE sharing its top-k), no MTP: one scanned stack."""
    from helpers import tiny
    return tiny(**{**dict(num_hidden_layers=2, indexer_types=("full", "shared"), num_nextn_predict_layers=0), **kw})


STAGE, MODE, BIAS_RATE = "pretrain", "sparse", 1e-2  # the stage's trainable set: every parameter but the indexers


def trainable():
    from glmjax.train.stages import STAGES, TRAINABLE
    return TRAINABLE[STAGES[STAGE].trainable]


def make_tx(params, cfg):
    from glmjax.optim import build_optimizer
    from glmjax.optim.config import default_optim_config
    return build_optimizer(params, {**default_optim_config(name="adamw", lr=1e-2, warmup_steps=0).to_dict(),
                                    "total_steps": 100}, cfg)[0]


def make_step(graphdef, tx, mesh=None, state=None):
    """The trainer's train step of STAGE, (params, rest, opt_state, batch, step) -> (params, rest, opt_state,
    metrics): jitted, donating the state; with `mesh`, sharded like state = (params, rest, opt_state)."""
    from glmjax.train.step import make_train_step
    return make_train_step(graphdef, tx, STAGE, MODE, BIAS_RATE, mesh=mesh, state=state)


def batch_rows(step: int, cfg):
    """The global batch of `step` as numpy arrays (tokens, segment_ids, positions): two documents per row, each an
    arithmetic sequence t_{i+1} = t_i + d (mod 64) with d in 1..3, so the loss can fall within a few steps."""
    rng = np.random.default_rng(1000 + step)
    cut = rng.integers(8, SEQ - 8, BATCH)
    seg = np.where(np.arange(SEQ)[None] < cut[:, None], 1, 2).astype(np.int32)
    pos = np.where(seg == 1, np.arange(SEQ)[None], np.arange(SEQ)[None] - cut[:, None]).astype(np.int32)
    start, d = rng.integers(0, 64, (BATCH, 2)), rng.integers(1, 4, (BATCH, 2))
    doc = seg - 1
    tok = (np.take_along_axis(start, doc, 1) + pos * np.take_along_axis(d, doc, 1)) % 64
    return tok.astype(np.int32), seg, pos


def reference_losses(n_steps: int):
    """Single device, unsharded: the losses of n_steps steps."""
    import jax.numpy as jnp
    from flax import nnx
    from glmjax.model import GLM, Batch
    cfg = small_cfg()
    graphdef, params, rest = nnx.split(GLM(cfg, nnx.Rngs(0)), trainable(), ...)
    tx = make_tx(params, cfg)
    opt_state = tx.init(params)
    step = make_step(graphdef, tx)
    losses = []
    for i in range(n_steps):
        params, rest, opt_state, m = step(params, rest, opt_state, Batch(*batch_rows(i, cfg)), jnp.int32(i))
        losses.append(float(m["loss"]))
    return losses


# ----- context parallelism: every stage's loss and gradients (tests/test_context_parallel.py, and the workers) -----
S = 56  # 7 tokens per zig-zag chunk on 4 context shards; a multiple of no block (block_q 16, loss_chunk 20)
DOCS = ((20, 25, 11), (56,), (9, 30, 10), (3, 40, 9))  # every row crosses shard boundaries; row 3 ends in padding
FAST = {"xla_backend_optimization_level": 0}  # halves XLA:CPU's compile time of these tiny programs
TEMPERATURE = 0.7
CONTEXT_MESH = dict(data=1, fsdp=1, expert=1, context=4, tensor=2)  # multi-host: context shards on both processes


def context_cfg(impl: str = "xla"):
    """Layer 0 dense with its indexer, layer 1 MoE sharing its top-k (IndexShare), the MTP layer for 2 depths."""
    from helpers import tiny
    return tiny(attention_impl=impl, num_hidden_layers=2, first_k_dense_replace=1, indexer_types=("full", "shared"),
                mtp_depth=2, init_std=0.1)  # init_std: a KL far from 0 (no cancellation in the 1e-5 check)


def packed_batch(vocab: int):
    """(Batch with an SFT loss mask, per-token PPO weights [B,S]) as numpy arrays: packed documents."""
    from glmjax.model import Batch
    from helpers import batch_from_docs
    rng = np.random.default_rng(0)
    b = batch_from_docs([[rng.integers(1, vocab, n) for n in row] for row in DOCS], S)
    mask = (rng.random((len(DOCS), S)) < 0.6).astype(np.int32)
    return Batch(*(np.asarray(a) for a in b[:3]), mask), rng.normal(size=(len(DOCS), S)).astype(np.float32)


GROUPS = ("sparse", "dense", "ppo")  # the stage groups of all_stages
MULTIHOST_GROUPS = ("sparse",)  # across processes: DSA's gathers and top-k (the suite's time budget; 8 devices: all)


def all_stages(graphdef, groups=GROUPS):
    """(params, rest, batch, ppo weights) -> {stage group: ((loss, metrics), grads)}, per-token forward outputs
    ({} without "ppo"); groups: which of GROUPS.

    The dense stages are one loss: LM + MTP on the SFT mask (sft; pretrain is the same path without a mask) plus the
    indexer KL against dense attention (dense_warmup): the KL reaches only the indexers and the LM terms never do,
    so the gradient holds each stage's gradient on its own parameters and the metrics each stage's loss. The sparse
    stages (sparse_adapt; indexshare: layer 1 shares layer 0's top-k and its indexer distils toward both layers'
    attention) are the LM + MTP + indexer KL in sparse mode, no mask. PPO: the actor's log-prob path (h back in
    natural order, log-probs of the next token) with the dense top-k diagnostics of the same forward."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from glmjax.rl.trainer import token_logprobs

    def fn(params, rest, batch, w):
        def stage(mode, b):
            def f(p):
                loss, m = nnx.merge(graphdef, p, rest).loss(b, mode, lm_weight=1.0, index_loss_weight=1.0)
                return loss, {k: m[k] for k in ("lm_loss", "mtp_loss", "index_kl")}
            return jax.value_and_grad(f, has_aux=True)(params)

        def ppo(p):
            m = nnx.merge(graphdef, p, rest)
            h, aux = m(batch._replace(loss_mask=None), "dense", topk_stats=True)
            lp, ent = token_logprobs(h, m.lm_head[...], batch.tokens, TEMPERATURE, m.cfg.loss_chunk)
            return jnp.sum((lp + 0.1 * ent) * w), (lp, aux.attn_topk, aux.index_topk)

        out = {}
        if "sparse" in groups:
            out["sparse_adapt+indexshare"] = stage("sparse", batch._replace(loss_mask=None))
        if "dense" in groups:
            out["pretrain/sft+dense_warmup"] = stage("dense", batch)
        if "ppo" not in groups:
            return out, {}
        (loss, fwd), grads = jax.value_and_grad(ppo, has_aux=True)(params)
        out["ppo"] = ((loss, {}), grads)
        return out, dict(zip(("logp", "attn_topk", "index_topk"), fwd))

    return fn


def context_reference(groups=GROUPS):
    """One device, XLA attention: (graphdef, params, rest, batch, w, all_stages' results as numpy)."""
    import jax
    from flax import nnx
    from glmjax.model import GLM
    c = context_cfg("xla")
    graphdef, params, rest = nnx.split(GLM(c, nnx.Rngs(0)), nnx.Param, ...)
    batch, w = packed_batch(c.vocab_size)
    out = jax.jit(all_stages(graphdef, groups), compiler_options=FAST)(params, rest, batch, w)
    return graphdef, params, rest, batch, w, jax.device_get(out)


def assert_equal_to_reference(got, want):
    """all_stages' results: losses and metrics (f32, <= 1e-5 relative), every gradient (<= 1e-5 relative norm),
    per-token log-probs, the indexer's top-k identical, the attention's top-k identical on document queries."""
    import jax
    (stages, fwd), (stages1, fwd1) = got, want
    for name, ((loss, metrics), grads) in stages.items():
        (loss1, metrics1), grads1 = stages1[name]
        np.testing.assert_allclose(loss, loss1, rtol=1e-5, err_msg=name)
        for k in metrics:
            np.testing.assert_allclose(metrics[k], metrics1[k], rtol=1e-5, err_msg=f"{name} {k}")
        for (path, g), g1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads1)):
            norm = np.linalg.norm(g1)
            err = np.linalg.norm(g - g1) / norm if norm else np.abs(g).max()
            assert err <= 1e-5, (name, jax.tree_util.keystr(path), err)
    assert stages.keys() == stages1.keys() and fwd.keys() == fwd1.keys()
    if not fwd:
        return
    np.testing.assert_allclose(fwd["logp"], fwd1["logp"], atol=2e-5, rtol=1e-5)  # per token, natural order
    np.testing.assert_array_equal(fwd["index_topk"], fwd1["index_topk"])  # the indexer's top-k: identical
    # the attention's top-k (streamed on the mesh, materialised on one device: near-ties may order differently) on
    # the queries of documents (padding queries see only padding keys, all but tied)
    real = np.arange(S)[None] < np.asarray([sum(row) for row in DOCS])[:, None]  # [B,S] not padding
    np.testing.assert_array_equal(fwd["attn_topk"][:, real], fwd1["attn_topk"][:, real])


def context_stages_on_mesh(mesh, impl: str = "xla", rows=None, groups=GROUPS):
    """all_stages on `mesh` (zig-zag layout), state created sharded; rows: this process's rows (None: all)."""
    import jax
    from flax import nnx
    from glmjax import parallel as par
    from glmjax.model import GLM
    c = context_cfg(impl)
    graphdef, params, rest = par.create_sharded(lambda: GLM(c, nnx.Rngs(0)), mesh, nnx.Param, ...)
    batch, w = packed_batch(c.vocab_size)
    rows = np.arange(len(DOCS)) if rows is None else rows
    batch, w = par.global_batch(jax.tree.map(lambda a: a[rows], (batch, w)), mesh, len(DOCS))
    assert batch.tokens.sharding.spec[1] == "context"
    return jax.jit(par.with_mesh(all_stages(graphdef, groups), mesh), compiler_options=FAST)(
        params, rest, batch, w)


def worker(process_id: int, num_processes: int, port: int, ckpt_dir: str, out_json: str):
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from glmjax import parallel as par
    par.initialize_distributed(par.default_parallel_config(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id))
    assert jax.process_count() == num_processes and jax.device_count() == 8, (jax.process_count(), jax.devices())

    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.experimental import multihost_utils
    from glmjax.model import GLM, Batch

    cfg = small_cfg()
    mesh = par.make_mesh(MULTIHOST_MESH)
    graphdef, params, rest = par.create_sharded(lambda: GLM(cfg, nnx.Rngs(0)), mesh, trainable(), ...)
    tx = make_tx(params, cfg)
    opt_state = par.init_opt_state(tx, params, mesh)
    step = make_step(graphdef, tx, mesh, (params, rest, opt_state))
    rows = par.process_rows(par.batch_sharding(mesh), BATCH)
    assert len(rows) == BATCH // num_processes, rows  # each process holds (and loads) only its share

    losses = []

    def train(params, rest, opt_state, steps):
        for i in steps:
            full = batch_rows(i, cfg)
            batch = Batch(*par.global_batch(tuple(a[rows] for a in full), mesh, BATCH))
            gathered = multihost_utils.process_allgather(batch.tokens, tiled=True)
            assert np.array_equal(gathered, full[0]), "process rows landed in the wrong global rows"
            params, rest, opt_state, m = step(params, rest, opt_state, batch, jnp.int32(i))
            losses.append(float(m["loss"]))
        return params, rest, opt_state

    params, rest, opt_state = train(params, rest, opt_state, range(STEPS_BEFORE))
    state = {"params": params, "rest": rest, "opt_state": opt_state}
    path = os.path.join(ckpt_dir, str(STEPS_BEFORE))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(path, par.abstract(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.sharding == b.sharding
        for sa, sb in zip(a.addressable_shards, b.addressable_shards):
            assert np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
    del state, params, rest, opt_state  # continue from the restored arrays only
    train(restored["params"], restored["rest"], restored["opt_state"], range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    if process_id == 0:
        with open(out_json, "w") as f:
            json.dump({"losses": losses, "rows": rows.tolist()}, f)

    # context parallelism with the sequence split across the processes: the sparse stages' loss and gradients
    cmesh = par.make_mesh(CONTEXT_MESH)
    crows = par.process_rows(par.batch_sharding(cmesh), len(DOCS))
    assert len(crows) == len(DOCS), crows  # each process holds every row's share of the sequence
    out = context_stages_on_mesh(cmesh, rows=crows, groups=MULTIHOST_GROUPS)
    flat = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(out)]
    if process_id == 0:
        np.savez(context_npz(out_json), *flat)

    # decoding on that mesh: the caches split over context across the processes (tests/test_decode_sharded.py)
    from test_decode_sharded import decode_run
    logits, tokens, logprobs = decode_run(cmesh)
    if process_id == 0:
        np.savez(decode_npz(out_json), logits=logits, tokens=tokens, logprobs=logprobs)
    check_claims(process_id, ckpt_dir)
    jax.distributed.shutdown()


def check_claims(process_id: int, root: str):
    """One run per workdir in a multi-process run (glmjax/train/claim.py): process 0 alone holds a free workdir's
    lock, released at the end; on a busy workdir both processes stop, process 1 told by process 0."""
    import socket

    from jax.experimental import multihost_utils
    from glmjax.train.claim import LOCK, WorkdirBusy, claim

    free, busy = os.path.join(root, "free"), os.path.join(root, "busy")
    if process_id == 0:
        os.makedirs(busy)
        with open(os.path.join(busy, LOCK), "w") as f:  # held by a live process of this host: the test's
            json.dump({"host": socket.gethostname(), "pid": os.getppid(), "since": "now"}, f)
    multihost_utils.sync_global_devices("busy lock written")
    with claim(free):
        with open(os.path.join(free, LOCK)) as f:
            holder = json.load(f)
        assert (holder["pid"] == os.getpid()) == (process_id == 0), holder
        multihost_utils.sync_global_devices("both claimed")
    multihost_utils.sync_global_devices("released")
    assert not os.path.exists(os.path.join(free, LOCK))
    try:
        with claim(busy):
            raise AssertionError(f"process {process_id} claimed a busy workdir")
    except WorkdirBusy as e:
        assert ("in use by another run" if process_id == 0 else "refused by process 0") in str(e), e


def context_npz(out_json: str) -> str:
    """Where the workers' context-parallel results go (process 0 writes them: all_stages' leaves, in order)."""
    return os.path.splitext(out_json)[0] + "_context.npz"


def decode_npz(out_json: str) -> str:
    """Where process 0 writes the decoder's results on the context mesh (logits, tokens, logprobs)."""
    return os.path.splitext(out_json)[0] + "_decode.npz"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
