"""Sharding on 8 CPU devices: mesh from config, the logical-axis rules, state created sharded, the sharded train step
(loss, gradients, expert load and router biases equal the single-device step), expert parallelism (all-to-all and
ragged all-to-all dispatch, dropless and with a capacity factor, against independent references)."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P

import glmjax.model.moe as moe_mod
from glmjax import parallel as par
from glmjax.config import ConfigError
from glmjax.model import GLM, Batch
from glmjax.model.moe import MoE, grouped_matmul_blocked
from glmjax.optim import build_optimizer
from glmjax.optim.config import default_optim_config
from helpers import tiny
from sharded_training import BATCH, MODE, batch_rows, make_step, make_tx, small_cfg, trainable

MESHES = {
    "data8": dict(data=8),
    "fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2),
    "expert4_data2": dict(data=2, expert=4),
    "fsdp2_expert2_tensor2": dict(data=1, fsdp=2, expert=2, tensor=2),
}


def sizes(mesh):
    return {a: mesh.shape[a] for a in par.MESH_AXES}


# ------------------------------------------------------------------------------------------------ mesh, rules


def test_mesh_from_config_sizes_and_errors():
    mesh = par.make_mesh(par.default_parallel_config(fsdp=2, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor")
    assert sizes(mesh) == dict(data=2, fsdp=2, expert=1, context=1, tensor=2)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert sizes(par.make_mesh(None)) == dict(data=8, fsdp=1, expert=1, context=1, tensor=1)
    assert sizes(par.make_mesh(dict(data=2, fsdp=-1))) == dict(data=2, fsdp=4, expert=1, context=1, tensor=1)
    assert sizes(par.make_mesh(dict(context=4))) == dict(data=2, fsdp=1, expert=1, context=4, tensor=1)
    with pytest.raises(ConfigError, match="only one mesh axis may be -1"):
        par.make_mesh(dict(data=-1, fsdp=-1))
    with pytest.raises(ConfigError, match=r"parallel.data=-1: the other axes multiply to 3"):
        par.make_mesh(dict(fsdp=3))
    with pytest.raises(ConfigError, match="has 4 devices, there are 8"):
        par.make_mesh(dict(data=2, fsdp=2))
    with pytest.raises(ConfigError, match="parallel.tensor=0"):
        par.make_mesh(dict(tensor=0))


def test_multislice_mesh_puts_the_data_axis_across_slices():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu too
    topologies = pytest.importorskip("jax.experimental.topologies")
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", num_slices=2).devices
    mesh = par.make_mesh(dict(data=2, fsdp=2, tensor=2), devices)
    for d in range(2):  # each data index is one slice: only data-parallel traffic crosses the slow network
        assert {dev.slice_index for dev in mesh.devices[d].flat} == {d}
    with pytest.raises(ConfigError, match="multiple of the 2 slices"):
        par.make_mesh(dict(data=1, fsdp=4, tensor=2), devices)


def test_every_logical_axis_of_the_model_has_a_rule():
    cfg = tiny()  # dense + MoE layers, indexers, MTP: every kind of parameter
    names = {n for v in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0)))),
                                       is_leaf=lambda x: isinstance(x, nnx.Variable))
             for n in v.get_metadata()["out_sharding"]}
    assert names - {None} <= set(par.LOGICAL_RULES), names - set(par.LOGICAL_RULES)
    assert {"embed", "experts", "heads", "vocab", "layers"} <= names


def test_logical_spec_resolution():
    mesh = par.make_mesh(MESHES["fsdp2_expert2_tensor2"])
    spec = lambda axes, shape: par.logical_spec(axes, shape, mesh)
    assert spec(("experts", "embed", "expert_mlp"), (16, 128, 64)) == P("expert", "fsdp", "tensor")
    assert spec(("embed", "mlp"), (128, 256)) == P(("fsdp", "expert"), "tensor")
    assert spec(("embed", "mlp"), (6, 256)) == P("fsdp", "tensor")  # 6 splits 2 ways, not 4: the rest replicates
    assert spec(("layers", "norm"), (3, 128)) == P(None, None)
    assert spec(("no_such_axis", None), (4, 4)) == P(None, None)
    assert par.logical_spec(("embed", "mlp"), (128, 256), par.make_mesh(MESHES["data8"])) == P(None, None)
    assert par.batch_spec(mesh) == P(("fsdp", "expert")) and par.num_batch_shards(mesh) == 4
    cp = par.make_mesh(dict(data=1, expert=2, context=4))  # routed experts: context first, expert where it divides
    assert par.logical_spec(moe_mod.EXPERT_IN_AXES, (16, 128, 64), cp) == P(("context", "expert"), None, None)
    assert par.logical_spec(moe_mod.EXPERT_IN_AXES, (4, 128, 64), cp) == P("context", "expert", None)


# ------------------------------------------------------------------------------------- sharded train step


def planned_divisor(path: tuple, s: dict) -> int:
    """How many ways the plan splits each parameter, written down from the layout (not from the rules code):
    FSDP (fsdp x expert) splits every weight's model width D (or, lacking one, its latent rank), tensor splits
    heads / MLP hidden / vocabulary, expert splits the routed experts; norms and router biases stay whole."""
    f, e, t = s["fsdp"], s["expert"], s["tensor"]
    name = path[-1] if path[-1] != "weight" and path[-1] != "bias" else "norm"
    return {"experts_gate": e * f * t, "experts_up": e * f * t, "experts_down": e * f * t,
            "embed_tokens": t * f * e, "lm_head": t * f * e, "gate_proj": f * e * t, "up_proj": f * e * t,
            "down_proj": f * e * t, "q_a_proj": f * e, "kv_a_proj_with_mqa": f * e, "q_b_proj": f * e * t,
            "kv_b_proj": f * e * t, "o_proj": t * f * e, "gate": f * e, "wk": f * e, "weights_proj": f * e * t,
            "wq_b": f * e * t, "e_score_correction_bias": 1, "norm": 1}[name]


EXPECTED_SPECS = {  # (experts_gate [L,E,D,I], q_b_proj [L,r_q,H,d], embed_tokens [V,D]) per mesh
    "fsdp4_tensor2": (P(None, None, "fsdp", "tensor"), P(None, "fsdp", "tensor", None), P("tensor", "fsdp")),
    "expert4_data2": (P(None, "expert", None, None), P(None, "expert", None, None), P(None, "expert")),
    "fsdp2_expert2_tensor2": (P(None, "expert", "fsdp", "tensor"), P(None, ("fsdp", "expert"), "tensor", None),
                              P("tensor", ("fsdp", "expert"))),
}


@pytest.fixture(scope="module")
def reference():
    """One unsharded step on one device: initial state, gradients, the step's new state (params, router biases,
    AdamW moments) and metrics (loss, gradient norm, load imbalance of the expert load, ...)."""
    cfg = small_cfg()
    graphdef = nnx.split(nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0))), trainable(), ...)[0]
    # created by one jit, as create_sharded does, but unsharded: under the tests' fast-compile XLA flags
    # (tests/xla_flags.py) an eager initialiser rounds the truncated normal's last bit differently
    params, rest = jax.jit(lambda: nnx.split(GLM(cfg, nnx.Rngs(0)), trainable(), ...)[1:])()
    tx = make_tx(params, cfg)
    batch = Batch(*batch_rows(0, cfg))
    grads = jax.grad(lambda p: nnx.merge(graphdef, p, rest).loss(batch, MODE)[0])(params)
    copy = jax.tree.map(jnp.copy, (params, rest))  # the step donates its inputs
    out = make_step(graphdef, tx)(*copy, tx.init(params), batch, jnp.int32(1))
    return dict(params=params, rest=rest, grads=jax.device_get(grads), out=jax.device_get(out))


def flat(state) -> dict:
    return traverse_util.flatten_dict(nnx.to_pure_dict(state))


def bytes_on_device0(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


# data8 (pure data parallelism, replicated parameters) is left out for time: every mesh here splits the batch too
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MESHES if n != "data8"])
def test_sharded_train_step_equals_single_device(name, reference):
    cfg = small_cfg()
    mesh = par.make_mesh(MESHES[name])
    graphdef, params, rest = par.create_sharded(lambda: GLM(cfg, nnx.Rngs(0)), mesh, trainable(), ...)
    # created sharded, with the same values as the unsharded model
    for a, b in zip(jax.tree.leaves((params, rest)), jax.tree.leaves((reference["params"], reference["rest"]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    layer = params["stacks"][0]["units"]["layers"]
    specs = (layer[1]["mlp"]["experts_gate"][...].sharding.spec, layer[0]["self_attn"]["q_b_proj"][...].sharding.spec,
             params["embed_tokens"][...].sharding.spec)
    assert specs == EXPECTED_SPECS[name]
    # per-device bytes shrink as planned
    s = sizes(mesh)
    planned = sum(x.nbytes // planned_divisor(p, s) for p, x in {**flat(params), **flat(rest)}.items())
    total = sum(x.nbytes for x in jax.tree.leaves((params, rest)))
    assert bytes_on_device0((params, rest)) == planned, (bytes_on_device0((params, rest)), planned)
    assert planned < total / 3

    tx = make_tx(params, cfg)
    opt_state = par.init_opt_state(tx, params, mesh)
    assert bytes_on_device0(opt_state) <= 2 * bytes_on_device0(params) + 1024  # AdamW moments split like params
    shardings = [x.sharding for x in jax.tree.leaves((params, rest, opt_state))]
    step = make_step(graphdef, tx, mesh, (params, rest, opt_state))  # the trainer's step, sharded
    batch = Batch(*par.global_batch(batch_rows(0, cfg), mesh, BATCH))
    hlo = step.lower(params, rest, opt_state, batch, jnp.int32(1)).as_text()
    assert ("all_to_all" in hlo) == (s["expert"] > 1)  # expert parallelism only with an expert axis
    new_params, new_rest, new_opt, m = step(params, rest, opt_state, batch, jnp.int32(1))
    ref = reference["out"]
    assert int(m["skipped"]) == 0 and set(m) == set(ref[3])
    for k in m:  # loss, gradient norm, load imbalance of the GLOBAL expert load, ...
        np.testing.assert_allclose(float(m[k]), float(ref[3][k]), rtol=1e-5, err_msg=k)
    # AdamW's moments after one step are (1 - b1) g and (1 - b2) g^2: the gradients, leaf by leaf
    for g, r in zip(jax.tree.leaves(new_opt), jax.tree.leaves(ref[2])):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-6 * max(np.abs(r).max(), 1e-3))
    for a, b in zip(jax.tree.leaves(new_rest), jax.tree.leaves(ref[1])):  # router biases moved identically
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b, g in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref[0]), jax.tree.leaves(reference["grads"])):
        # AdamW's first step moves by lr * g / (|g| + eps): only where |g| >> eps is that well-conditioned
        well = np.abs(g) > 1e-6
        np.testing.assert_allclose(np.where(well, np.asarray(a), b), b, atol=1e-6)
    assert [x.sharding for x in jax.tree.leaves((new_params, new_rest, new_opt))] == shardings  # kept shardings


def test_state_is_initialised_without_a_full_copy_per_device():
    cfg = small_cfg()
    mesh = par.make_mesh(MESHES["fsdp4_tensor2"])
    _, init = par.sharded_init(lambda: GLM(cfg, nnx.Rngs(0)), mesh)
    mem = init.lower().compile().memory_analysis()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: GLM(cfg, nnx.Rngs(0))))))
    assert mem.output_size_in_bytes < total / 4
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < total / 2


def test_optimizer_state_shardings_follow_parameters_for_muon_split():
    cfg = small_cfg()
    mesh = par.make_mesh(MESHES["fsdp2_expert2_tensor2"])
    _, abs_params, _ = nnx.split(nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0))), trainable(), ...)
    params = par.abstract(abs_params, par.state_shardings(abs_params, mesh))
    tx, _ = build_optimizer(abs_params, {**default_optim_config(name="muon_split", warmup_steps=0).to_dict(),
                                    "total_steps": 10}, cfg)
    opt = jax.tree.leaves(par.opt_state_shardings(tx, params, mesh))
    abs_opt = jax.tree.leaves(jax.eval_shape(tx.init, params))
    by_shape = {}
    for x in jax.tree.leaves(params):
        by_shape.setdefault(x.shape, set()).add(x.sharding.spec)
    matched = 0
    for sh, a in zip(opt, abs_opt):
        if len(by_shape.get(a.shape, ())) == 1:
            assert sh.spec == next(iter(by_shape[a.shape])), a.shape
            matched += 1
    assert matched >= 10
    # the split kv_b_proj parts (W_UK / W_UV: no parameter has their shape) keep the heads split over tensor
    parts = [sh.spec for sh, a in zip(opt, abs_opt) if a.ndim == 4 and a.shape[-1] in (cfg.qk_nope_head_dim,
                                                                                       cfg.v_head_dim)]
    assert parts and all(p[2] == "tensor" for p in parts)


def test_global_batch_and_process_rows_single_process():
    mesh = par.make_mesh(MESHES["expert4_data2"])
    sh = par.batch_sharding(mesh)
    np.testing.assert_array_equal(par.process_rows(sh, 8), np.arange(8))
    tok = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    g = par.global_batch({"t": tok}, mesh, 8)["t"]
    assert g.sharding.spec == P(("data", "expert"))
    np.testing.assert_array_equal(np.asarray(g), tok)
    with pytest.raises(ValueError, match="not divisible by the 8 batch shards"):
        par.global_batch({"t": tok[:4]}, mesh, 4)


def test_context_axis_splits_the_sequence_and_shards_parameters_like_fsdp():
    mesh = par.make_mesh(dict(data=1, fsdp=2, context=2, tensor=2))
    assert par.batch_spec(mesh) == P("fsdp", ("context",)) and par.num_batch_shards(mesh) == 2
    assert par.token_axes(mesh) == ("fsdp", "context")
    assert par.logical_spec(("embed", "mlp"), (128, 256), mesh) == P(("fsdp", "context"), "tensor")
    assert par.logical_spec(("batch", "index_queries"), (4, 40), mesh) == P("fsdp", ("context", "tensor"))
    np.testing.assert_array_equal(par.process_rows(par.batch_sharding(mesh), 4), np.arange(4))  # rows only
    tok = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    g = par.global_batch({"t": tok}, mesh, 4)["t"]
    assert g.sharding.spec == P("fsdp", ("context",)) and g.addressable_shards[0].data.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(g), tok)
    with pytest.raises(ValueError, match=r"shape \(4, 5\): its sequence length must be divisible by the 2 context"):
        par.global_batch({"t": tok[:, :5]}, mesh, 4)


def test_distributed_args_from_config_then_environment(monkeypatch):
    for env in par.mesh.ENV.values():
        monkeypatch.delenv(env, raising=False)
    assert par.distributed_args(None) == dict(coordinator_address=None, num_processes=None, process_id=None)
    assert par.initialize_distributed(None) is False  # nothing asked for: one process, nothing started
    monkeypatch.setenv("GLMJAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("GLMJAX_NUM_PROCESSES", "4")
    pc = par.default_parallel_config(process_id=3, num_processes=2)
    assert par.distributed_args(pc) == dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=3)
    with pytest.raises(ConfigError, match="also needs parallel.process_id"):
        par.initialize_distributed(None)


# --------------------------------------------------------------------------------------- expert parallelism


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`lax.ragged_all_to_all` (which XLA:CPU lacks) from its documented semantics, with an all_gather."""
    ops, inp, snd, out = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                     output_offsets))
    me = jax.lax.axis_index(axis_name)
    r = jnp.arange(output.shape[0])
    result = output
    for i in range(ops.shape[0]):  # what source i sends to me lands at out[i, me]
        lo, n = out[i, me], snd[i, me]
        src = jnp.clip(inp[i, me] + r - lo, 0, ops.shape[1] - 1)
        hit = ((r >= lo) & (r < lo + n)).reshape((-1,) + (1,) * (output.ndim - 1))
        result = jnp.where(hit, ops[i][src], result)
    return result


def moe_grads(moe_cfg, state, y, mesh=None):
    graphdef = nnx.graphdef(MoE(moe_cfg, nnx.Rngs(0)))

    def f(st, y):
        out, load, dropped = nnx.merge(graphdef, st)(y)
        return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-1])), (out, load, dropped)

    fn = jax.value_and_grad(f, has_aux=True)
    if mesh is None:
        return jax.jit(fn)(state, y)
    sh = par.state_shardings(state, mesh)
    y_sh = par.batch_sharding(mesh) if y.shape[0] % par.num_batch_shards(mesh) == 0 else \
        jax.sharding.NamedSharding(mesh, P())
    return jax.jit(par.with_mesh(fn, mesh), in_shardings=(sh, y_sh))(jax.device_put(state, sh), y)


def moe_setup(**kw):
    cfg = tiny(**kw)
    moe = MoE(cfg, nnx.Rngs(3))
    moe.e_score_correction_bias[...] = 0.3 * jax.random.normal(jax.random.key(9), (cfg.n_routed_experts,))
    return cfg, nnx.state(moe)


@pytest.mark.slow
@pytest.mark.parametrize("name, dispatch", [("fsdp4_tensor2", "all_to_all"), ("expert4_data2", "all_to_all"),
                                            ("expert4_data2", "ragged_all_to_all"),
                                            ("fsdp2_expert2_tensor2", "ragged_all_to_all")])
def test_sharded_moe_equals_single_device(name, dispatch, monkeypatch):
    monkeypatch.setattr(moe_mod, "ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, state = moe_setup(moe_dispatch=dispatch)
    y = jax.random.normal(jax.random.key(4), (8, 6, cfg.hidden_size))
    (l0, (o0, load0, _)), g0 = moe_grads(cfg, state, y)
    (l1, (o1, load1, dropped)), g1 = moe_grads(cfg, state, y, par.make_mesh(MESHES[name]))
    np.testing.assert_allclose(o1, o0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(load1, load0)
    assert int(dropped) == 0  # dropless
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_sharded_moe_pads_a_token_count_the_mesh_does_not_divide():
    cfg, state = moe_setup()
    y = jax.random.normal(jax.random.key(5), (1, 3, cfg.hidden_size))  # 3 tokens on 8 token shards (decoding)
    (_, (o0, load0, _)), _ = moe_grads(cfg, state, y)
    mesh = par.make_mesh(MESHES["expert4_data2"])
    (_, (o1, load1, _)), _ = moe_grads(cfg, state, y, mesh)
    np.testing.assert_allclose(o1, o0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(load1, load0)  # the padding rows are not counted


@pytest.mark.slow
def test_moe_tokens_flatten_without_moving_data_when_the_sequence_is_split(monkeypatch):
    """expert=2 x context=4, 4 rows per expert shard: `flatten_tokens` hands the experts' shard_map each device's
    own tokens as one block of rows with no collective (a plain [B,S,D] -> [B*S,D] reshape needs them: the
    negative control), its inverse restores [B,S,D] exactly, and the sharded MoE -- experts split over context x
    expert, both dispatches -- equals one device's."""
    mesh = par.make_mesh(dict(data=1, expert=2, context=4))
    y = jax.random.normal(jax.random.key(6), (8, 8, 16))
    tokens = jax.sharding.NamedSharding(mesh, P(par.token_axes(mesh)))

    def collectives(flatten):
        lowered = jax.jit(flatten, in_shardings=par.batch_sharding(mesh), out_shardings=tokens).lower(y)
        text = lowered.compile().as_text()
        return sum(text.count(op) for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))

    assert collectives(lambda a: moe_mod.flatten_tokens(a, mesh.abstract_mesh)[0]) == 0
    assert collectives(lambda a: a.reshape(-1, a.shape[-1])) > 0
    x, unflatten = moe_mod.flatten_tokens(y, mesh.abstract_mesh)
    np.testing.assert_array_equal(unflatten(x), y)
    assert not np.array_equal(x, y.reshape(-1, 16))  # the rows are reordered (by batch shard, then context shard)

    # the 16 experts split 8 ways over context x expert (one expert-parallel group of two mesh axes)
    monkeypatch.setattr(moe_mod, "ragged_all_to_all", emulated_ragged_all_to_all)
    for dispatch in ("all_to_all", "ragged_all_to_all"):
        cfg, state = moe_setup(moe_dispatch=dispatch)
        y = jax.random.normal(jax.random.key(7), (8, 8, cfg.hidden_size))
        (l0, (o0, load0, _)), g0 = moe_grads(cfg, state, y)
        (l1, (o1, load1, _)), g1 = moe_grads(cfg, state, y, mesh)
        np.testing.assert_allclose(o1, o0, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(load1, load0)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def capacity_reference(cfg, state, y, n_shards, ep, cap, dispatch):
    """Numpy, float64: the MoE output when each token shard keeps, per destination expert shard, only the first
    `cap` (token, slot) rows in expert-then-token order (all_to_all), or when each destination keeps the first
    ep * cap rows it receives, sources in order (ragged_all_to_all). -> (out, number of dropped rows)."""
    x = np.asarray(y, np.float64).reshape(-1, cfg.hidden_size)
    p = {k: np.asarray(v[...], np.float64) for k, v in state.items() if not isinstance(v, nnx.State)}
    sh = {k: np.asarray(v[...], np.float64) for k, v in state["shared_experts"].items()}
    w, ids = (np.asarray(a) for a in moe_mod.route(cfg, jnp.asarray(x @ p["gate"], jnp.float32),
                                                   jnp.asarray(p["e_score_correction_bias"], jnp.float32)))
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    e_local, n = E // ep, x.shape[0] // n_shards
    silu = lambda z: z / (1 + np.exp(-z))
    expert = lambda e, v: (silu(v @ p["experts_gate"][e]) * (v @ p["experts_up"][e])) @ p["experts_down"][e]
    kept = np.zeros((x.shape[0], K), bool)
    received = {}  # (EP group, destination) -> rows received so far (ragged)
    for src in range(n_shards):
        group, rank_in_group = divmod(src, ep)
        pairs = sorted(((ids[t, k], t, k) for t in range(src * n, (src + 1) * n) for k in range(K)))
        per_dest = {}
        for e, t, k in pairs:
            d = e // e_local
            if dispatch == "all_to_all":
                per_dest[d] = per_dest.get(d, 0) + 1
                kept[t, k] = per_dest[d] <= cap
            else:
                received[group, d] = received.get((group, d), 0) + 1
                kept[t, k] = received[group, d] <= ep * cap
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            if kept[t, k]:
                out[t] += w[t, k] * expert(ids[t, k], x[t])
        out[t] += (silu(x[t] @ sh["gate_proj"]) * (x[t] @ sh["up_proj"])) @ sh["down_proj"]
    return out, int((~kept).sum())


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["all_to_all", "ragged_all_to_all"])
def test_capacity_factor_drops_exactly_the_rows_past_capacity(dispatch, monkeypatch):
    monkeypatch.setattr(moe_mod, "ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, state = moe_setup(moe_dispatch=dispatch, moe_capacity_factor=0.5)
    mesh = par.make_mesh(MESHES["expert4_data2"])
    y = jax.random.normal(jax.random.key(6), (8, 4, cfg.hidden_size))
    (_, (out, _, reported)), _ = moe_grads(cfg, state, y, mesh)
    n, K, ep = 4, cfg.num_experts_per_tok, 4  # 32 tokens over 8 shards; experts over 4
    cap = math.ceil(0.5 * n * K / ep)
    ref, dropped = capacity_reference(cfg, state, y, 8, ep, cap, dispatch)
    assert dropped > 0  # the capacity really binds ...
    np.testing.assert_allclose(np.asarray(out).reshape(ref.shape), ref, rtol=1e-4, atol=1e-5)
    assert int(reported) == dropped  # the MoE reports the global count of dropped (token, slot) pairs
    (_, (dropless, _, none)), _ = moe_grads(cfg.replace(moe_capacity_factor=0.0), state, y, mesh)
    assert not np.allclose(np.asarray(dropless), np.asarray(out), atol=1e-3)  # ... and changes the output
    assert int(none) == 0


def test_blocked_grouped_matmul_gives_zero_rows_past_the_group_total():
    sizes = jnp.asarray([3, 0, 2], jnp.int32)
    xs = jax.random.normal(jax.random.key(0), (9, 5))
    w = jax.random.normal(jax.random.key(1), (3, 5, 4))
    out = grouped_matmul_blocked(xs, w, sizes)
    np.testing.assert_array_equal(out[5:], 0)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(xs, w, sizes), atol=1e-5)


def test_shard_train_step_takes_any_pure_step_with_extra_arguments():
    mesh = par.make_mesh(MESHES["fsdp4_tensor2"])
    sh = jax.sharding.NamedSharding(mesh, P("fsdp", "tensor"))
    params = {"w": jax.device_put(jnp.ones((8, 4)), sh)}
    rest = {"n": jax.device_put(jnp.zeros((), jnp.int32), jax.sharding.NamedSharding(mesh, P()))}
    opt = {"m": jax.device_put(jnp.zeros((8, 4)), sh)}

    def step_fn(p, r, o, batch, lr):
        g = jnp.mean(batch, axis=0)[None, :] * jnp.ones_like(p["w"])
        m = 0.5 * o["m"] + g
        return {"w": p["w"] - lr * m}, {"n": r["n"] + 1}, {"m": m}, {"gsum": jnp.sum(g)}

    step = par.shard_train_step(step_fn, mesh, params, rest, opt, extra_args=1)
    batch = par.global_batch(np.arange(16, dtype=np.float32).reshape(4, 4), mesh, 4)
    w0 = params["w"]
    p, r, o, m = step(params, rest, opt, batch, 0.1)
    np.testing.assert_allclose(p["w"], 1 - 0.1 * np.arange(6, 10, dtype=np.float32)[None].repeat(8, 0), rtol=1e-6)
    assert int(r["n"]) == 1 and float(m["gsum"]) == 8 * (6 + 7 + 8 + 9)
    assert p["w"].sharding == sh and o["m"].sharding == sh and m["gsum"].sharding.is_fully_replicated
    assert w0.is_deleted()  # donated: the update reused its buffer
