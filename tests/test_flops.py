"""glmjax.flops against independent references: the docs/model.md A.1/A.2 parameter totals, the actual NNX parameter
tree, XLA's own FLOP count of the compiled model code (forward of single layers, an absorbed decode step, the MTP layer
and a whole model), brute-force sums, and the structural claims (sparse vs dense, IndexShare in between)."""
import os
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax import flops as F
from glmjax.model import GLM, Batch
from glmjax.model.indexer import index_logits
from glmjax.model.layers import apply_rope, dense, rope_tables
from glmjax.model.latent_attention import dense_mla
from glmjax.model.mla import MLA, Ctx
from glmjax.model.moe import MLP, MoE
from glmjax.model import sparse_attention
from glmjax.model.sparse_attention import sparse_mla_xla
from glmjax.model.transformer import MTP
from helpers import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def glm5():
    return F.load_model_config(os.path.join(ROOT, "configs", "glm5.py"))


@pytest.fixture(scope="module")
def glm52():
    return F.load_model_config(os.path.join(ROOT, "configs", "glm52.py"))


# =============================================================================================== parameters


def test_glm5_totals_are_the_checkpoint_totals(glm5):
    # docs/model.md A.1: counted from the GLM-5.1 checkpoint shapes
    assert F.total_params(glm5.replace(num_nextn_predict_layers=0)) == 743_911_218_432
    assert F.total_params(glm5) == 753_864_139_008
    assert F.total_params(glm5, include_mtp=False) == 743_911_218_432
    assert F.indexer_params(glm5) == 9_371_904
    assert F.param_counts(glm5.replace(num_nextn_predict_layers=0))["mtp"] == 0


def test_glm52_is_glm5_minus_57_indexers(glm5, glm52):
    assert glm52.layer_indexer_types.count("shared") == 57
    for mtp in (0, 1):
        a, b = (c.replace(num_nextn_predict_layers=mtp) for c in (glm5, glm52))
        assert F.total_params(a) - F.total_params(b) == 57 * 9_371_904 == 534_198_528
    diff = {k: F.param_counts(glm5)[k] - F.param_counts(glm52)[k] for k in F.PARAM_COMPONENTS}
    assert diff == {**dict.fromkeys(F.PARAM_COMPONENTS, 0), "indexer": 534_198_528}


def _name(p):
    for attr in ("key", "name", "idx"):
        if hasattr(p, attr):
            return str(getattr(p, attr))
    raise TypeError(p)


LAYER_NORMS = {"input_layernorm", "post_attention_layernorm"}


def _layer_component(names):
    if "indexer" in names:
        return "indexer"
    if "self_attn" in names:
        return "mla"
    if LAYER_NORMS & set(names):
        return "norms"
    assert "mlp" in names, names
    if "shared_experts" in names:
        return "shared_experts"
    leaf = names[names.index("mlp") + 1]
    if leaf.startswith("experts_"):
        return "routed_experts"
    if leaf in ("gate", "e_score_correction_bias"):
        return "router"
    assert leaf in ("gate_proj", "up_proj", "down_proj"), names
    return "dense_mlp"


def tree_counts(cfg, active=False):
    """Classify every leaf of the NNX state of GLM(cfg) by its path -> ({component: n}, {mtp component: n}).
    active: routed-expert leaves (leading expert axis E) count K_e / E of their size."""
    abstract = nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0)))
    main, mtp = Counter(), Counter()
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(abstract))[0]:
        names = [_name(p) for p in path]
        n = int(np.prod(leaf.shape))
        if active and "mlp" in names and names[names.index("mlp") + 1].startswith("experts_"):
            E = cfg.n_routed_experts
            assert leaf.shape[-3] == E
            n = n * cfg.num_experts_per_tok // E
        if names[0] == "mtp":
            sub = names[1]
            comp = {"eh_proj": "eh_proj", "enorm": "norms", "hnorm": "norms", "shared_head_norm": "norms"}.get(sub)
            mtp[comp or _layer_component(names)] += n
            main["mtp"] += n
        elif names[0] == "embed_tokens":
            main["embedding"] += n
        elif names[0] == "lm_head":
            main["lm_head"] += n
        elif names[0] == "norm":
            main["norms"] += n
        else:
            assert names[0] == "stacks", names
            main[_layer_component(names)] += n
    return main, mtp


TINY_VARIANTS = {
    "spec_a5": {},  # F F S S F S, 1 dense layer, MTP
    "no_mtp": dict(num_nextn_predict_layers=0),
    "mtp_depth_0": dict(mtp_depth=0),  # has_mtp is False: no MTP module
    "all_full_no_dense_no_shared_expert": dict(indexer_types=None, first_k_dense_replace=0, n_shared_experts=0),
    "freq3_two_shared_experts": dict(indexer_types=None, index_topk_freq=3, index_skip_topk_offset=1,
                                     num_hidden_layers=7, first_k_dense_replace=2, n_shared_experts=2),
    "all_dense_layers": dict(first_k_dense_replace=6, num_experts_per_tok=2),
}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_param_counts_equal_the_nnx_tree_by_component(variant):
    cfg = tiny(**TINY_VARIANTS[variant])
    for active in (False, True):
        main, mtp = tree_counts(cfg, active)
        counts = F.param_counts(cfg, active=active)
        assert counts == {k: main.get(k, 0) for k in F.PARAM_COMPONENTS}, (variant, active)
        assert F.mtp_param_counts(cfg, active=active) == {k: mtp.get(k, 0) for k in F.MTP_PARAM_COMPONENTS}
        assert F.total_params(cfg, active=active) == sum(main.values())
        assert F.total_params(cfg, include_mtp=False, active=active) == sum(main.values()) - main.get("mtp", 0)


def test_active_params_glm5(glm5):
    """Active = total - (E - K_e) routed experts in each of the 75 MoE layers (+ the MTP layer)."""
    per_expert = 3 * 6144 * 2048
    assert F.total_params(glm5, active=True) == 753_864_139_008 - 76 * (256 - 8) * per_expert
    assert F.total_params(glm5, include_mtp=False, active=True) == 743_911_218_432 - 75 * 248 * per_expert


# =============================================================================================== FLOPs: XLA
# XLA's cost analysis counts 2 FLOPs per multiply-add of every dot *and* one per elementwise op, so on
# matmul-dominated shapes it must lie in [ours, ours * (1 + TOL)]. Two XLA facts shape these tests: a while loop
# (scan / lax.map) is counted once, not per trip, so layers are unrolled (scan_layers=False) and block_q >= S makes
# every lax.map a single trip; and the CPU lowering of ragged_dot computes every expert densely, so the whole-model
# check uses E = K_e = 1 (the MoE test below checks the E > 1 count through that dense lowering explicitly).
TOL = 0.02  # measured: 0.2% - 1.3% above ours on these shapes

MID = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
           first_k_dense_replace=1, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
           qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=1, n_shared_experts=1, num_experts_per_tok=1,
           n_group=1, topk_group=1, index_n_heads=4, index_head_dim=64, index_topk=64,
           indexer_types=("full", "shared", "full", "shared"), max_position_embeddings=1024, block_q=256,
           loss_chunk=256, scan_layers=False, num_nextn_predict_layers=1, mtp_depth=1, moe_impl="ragged_dot")
B, S = 2, 256


@pytest.fixture(autouse=True)
def one_sparse_block(monkeypatch):
    """The sparse attention caps its query block by gathered bytes; lift the cap so block_q >= S is one trip."""
    monkeypatch.setattr(sparse_attention, "gather_block_bytes", lambda: 2 ** 40)


def xla_flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def abstract_module(make):
    return nnx.split(nnx.eval_shape(make))


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def assert_close_above(xla, ours, tol=TOL):
    assert ours <= xla <= ours * (1 + tol), (xla, ours, xla / ours - 1)


def ctx_args(cfg, mode):
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    cos, sin = rope_tables(pos, cfg)
    return Ctx(cos, sin, jnp.ones((B, S), jnp.int32), mode)


def test_attention_cores_match_xla():
    """The per-pair counts alone: index scores, dense expanded MLA and gathered sparse MLA (T = S keys per query)."""
    cfg = tiny(**MID)
    H, H_I, d_I, r_kv, d_r = (cfg.num_attention_heads, cfg.index_n_heads, cfg.index_head_dim, cfg.kv_lora_rank,
                              cfg.qk_rope_head_dim)
    xla = xla_flops(index_logits, sds((B, S, H_I, d_I)), sds((B, S, d_I)), sds((B, S, H_I)))
    assert_close_above(xla, B * S * F.indexer_score_flops(cfg, S))

    def dense_core(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv):
        return jax.tree.leaves(dense_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, jnp.ones((B, S), jnp.int32), 0.1))[0]

    args = (sds((B, S, H, cfg.qk_nope_head_dim)), sds((B, S, H, d_r)), sds((B, S, r_kv)), sds((B, S, d_r)),
            sds((r_kv, H, cfg.qk_nope_head_dim)), sds((r_kv, H, cfg.v_head_dim)))
    # dense_mla expands K/V per key token: kv_up once per token
    assert_close_above(xla_flops(dense_core, *args), B * S * F.attention_flops(cfg, S, "expanded"))

    kk = cfg.index_topk
    xla = xla_flops(lambda q, kv, ids: sparse_mla_xla(q, kv, ids, scale=0.1, kv_lora_rank=r_kv, block_q=S)[0],
                    sds((B, S, H, r_kv + d_r)), sds((B, S, r_kv + d_r)), sds((B, S, kk), jnp.int32))
    # the absorption einsums (kv_up) live outside sparse_mla_xla
    assert_close_above(xla, B * S * (F.attention_flops(cfg, kk, "absorbed") - F.kv_up_flops(cfg)))


@pytest.mark.parametrize("layer", ["dense", "sparse_full", "sparse_shared"])
def test_attention_layer_forward_matches_xla(layer):
    cfg = tiny(**MID)
    has_indexer = layer == "sparse_full"
    mode = "dense" if layer == "dense" else "sparse"
    gd, st = abstract_module(lambda: MLA(cfg, has_indexer, nnx.Rngs(0)))
    ctx = ctx_args(cfg, mode)
    kk = min(cfg.index_topk, S)

    def f(st, x, topk):
        return nnx.merge(gd, st)(x, ctx, topk)[0]

    xla = xla_flops(f, st, sds((B, S, cfg.hidden_size)), sds((B, S, kk), jnp.int32))
    lf = F.layer_flops(cfg, S, "prefill", moe=False, sparse=mode == "sparse", has_indexer=has_indexer, causal=False)
    ours = B * S * (lf["mla_proj"] + lf["attention"] + lf["indexer"])
    assert_close_above(xla, ours)


def test_ffn_forward_matches_xla():
    cfg = tiny(**MID)
    gd, st = abstract_module(lambda: MLP(cfg, cfg.intermediate_size, nnx.Rngs(0)))
    xla = xla_flops(lambda st, y: nnx.merge(gd, st)(y), st, sds((B, S, cfg.hidden_size)))
    assert_close_above(xla, B * S * F.mlp_flops(cfg, cfg.intermediate_size))
    # MoE with E=8, K_e=2: XLA's CPU ragged_dot multiplies every row by every expert, i.e. E x our routed count
    # (minus the combine); everything else is counted as is.
    cfg = tiny(**{**MID, "n_routed_experts": 8, "num_experts_per_tok": 2})
    gd, st = abstract_module(lambda: MoE(cfg, nnx.Rngs(0)))
    xla = xla_flops(lambda st, y: nnx.merge(gd, st)(y)[0], st, sds((B, S, cfg.hidden_size)))
    m = F.moe_flops(cfg)
    combine = 2 * cfg.num_experts_per_tok * cfg.hidden_size
    dense_lowering = cfg.n_routed_experts * (m["routed_experts"] - combine) + combine
    rest = m["shared_experts"] + m["router"]
    if xla > 2 * B * S * (m["routed_experts"] + rest):  # dense lowering (jax 0.10 CPU)
        assert_close_above(xla, B * S * (dense_lowering + rest))
    else:  # a grouped lowering would count exactly what runs
        assert_close_above(xla, B * S * (m["routed_experts"] + rest))


@pytest.mark.parametrize("mode", ["dense", "dsa_indexshare"])
def test_whole_model_prefill_forward_matches_xla(mode):
    cfg = tiny(**MID)
    gd, st = abstract_module(lambda: GLM(cfg, nnx.Rngs(0)))
    code_mode = "dense" if mode == "dense" else "sparse"

    def f(st, tokens):
        m = nnx.merge(gd, st)
        batch = Batch(tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(S), tokens.shape))
        h, _ = m(batch, code_mode)
        return m.logits(h[:, -1])  # prefill: next-token logits of the last position

    xla = xla_flops(f, st, sds((B, S), jnp.int32))
    ours = B * S * F.flops_per_token(cfg, S, "prefill", mode, causal=False)["total"]
    assert_close_above(xla, ours)


@pytest.mark.parametrize("mode", ["dense", "dsa"])
def test_mtp_depth_forward_matches_xla(mode):
    cfg = tiny(**MID)
    gd, st = abstract_module(lambda: MTP(cfg, nnx.Rngs(0)))
    ctx = ctx_args(cfg, "dense" if mode == "dense" else "sparse")

    def f(st, emb, h):
        return nnx.merge(gd, st)(emb, h, ctx, jnp.float32)[0]

    xla = xla_flops(f, st, sds((B, S, cfg.hidden_size)), sds((B, S, cfg.hidden_size)))
    per = F.mtp_flops_per_token(cfg, S, "prefill", mode, causal=False)
    assert_close_above(xla, B * S * (sum(per.values()) - per["lm_head"]))  # head runs outside MTP.__call__


@pytest.mark.parametrize("T", [48, 256])  # below and above index_topk = 64
@pytest.mark.parametrize("sparse", [False, True])
def test_absorbed_decode_step_matches_xla(T, sparse):
    """One new token over a cache of T rows (itself included), docs/model.md D.2, written here from the module's
    weights."""
    cfg = tiny(**MID)
    gd, st = abstract_module(lambda: MLA(cfg, True, nnx.Rngs(0)))
    d_n, r_kv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    kk = min(cfg.index_topk, T)

    def step(st, x, c_cache, pe_cache, ik_cache):
        m = nnx.merge(gd, st)
        cos, sin = rope_tables(jnp.full((1, 1), T - 1), cfg)
        q_resid = m.q_a_layernorm(dense(x, m.q_a_proj[...], "bsd,dr->bsr", jnp.float32))
        q = dense(q_resid, m.q_b_proj[...], "bsr,rhd->bshd", jnp.float32)
        q_pe = apply_rope(q[..., d_n:], cos, sin, True)
        ckv = dense(x, m.kv_a_proj_with_mqa[...], "bsd,dc->bsc", jnp.float32)
        c_new, pe_new = m.kv_a_layernorm(ckv[..., :r_kv]), apply_rope(ckv[..., r_kv:], cos, sin, True)
        latent = jnp.concatenate([jnp.concatenate([c_cache, c_new], 1), jnp.concatenate([pe_cache, pe_new], 1)], -1)
        w_kv = m.kv_b_proj[...]
        w_uk, w_uv = w_kv[..., :d_n], w_kv[..., d_n:]
        q_abs = jnp.concatenate([jnp.einsum("bshd,chd->bshc", q[..., :d_n], w_uk), q_pe], -1)
        if sparse:
            qi, ki, wi = m.indexer(x, q_resid, cos, sin)
            ids = jax.lax.top_k(index_logits(qi, jnp.concatenate([ik_cache, ki], 1), wi), kk)[1]  # [1,1,kk]
            latent = jnp.take_along_axis(latent, ids[0, 0][None, :, None], axis=1)
        p = jax.nn.softmax(jnp.einsum("bshc,btc->bsht", q_abs, latent) * cfg.softmax_scale, -1)
        o = jnp.einsum("bshc,chv->bshv", jnp.einsum("bsht,btc->bshc", p, latent[..., :r_kv]), w_uv)
        return jnp.einsum("bshv,hvd->bsd", o, m.o_proj[...])

    args = (st, sds((1, 1, cfg.hidden_size)), sds((1, T - 1, r_kv)), sds((1, T - 1, cfg.qk_rope_head_dim)),
            sds((1, T - 1, cfg.index_head_dim)))
    xla = xla_flops(step, *args)
    lf = F.layer_flops(cfg, T, "decode", moe=False, sparse=sparse, has_indexer=sparse)
    assert_close_above(xla, lf["mla_proj"] + lf["attention"] + lf["indexer"])


# =============================================================================================== FLOPs: structure


def test_keys_per_query_is_the_brute_force_average():
    for T in (1, 5, 64, 100, 1000):
        for k in (None, 1, 8, 64, 2000):
            ts = np.arange(1, T + 1)
            want = np.mean(ts if k is None else np.minimum(ts, k))
            assert F.keys_per_query(T, k) == pytest.approx(want, rel=1e-12)
            assert F.keys_per_query(T, k, causal=False) == (T if k is None else min(k, T))


def test_training_is_three_forwards_except_the_indexer_top_k(glm52):
    T = 131072
    pre = F.flops_per_token(glm52, T, "prefill", "dsa_indexshare")
    tr = F.flops_per_token(glm52, T, "training", "dsa_indexshare", indexer_loss=False, mtp_depth=0)
    for k in ("mla_proj", "attention", "dense_mlp", "routed_experts", "shared_experts", "router"):
        assert tr[k] == pytest.approx(3 * pre[k], rel=1e-12), k
    assert tr["indexer"] == pytest.approx(pre["indexer"], rel=1e-12)  # forward only
    assert tr["lm_head"] == pytest.approx(3 * T * pre["lm_head"], rel=1e-12)  # every position, x3; prefill: last
    assert tr["indexer_loss"] == 0 == tr["mtp"]
    with_mtp = F.flops_per_token(glm52, T, "training", "dsa_indexshare", indexer_loss=False)
    per_depth = F.mtp_flops_per_token(glm52, T, "training", "dsa_indexshare", indexer_loss=False)
    assert with_mtp["mtp"] == pytest.approx(3 * sum(per_depth.values()), rel=1e-12)  # mtp_depth = 3


@pytest.mark.parametrize("phase", F.PHASES)
def test_sparse_attention_equals_dense_structure_up_to_k_and_is_cheaper_beyond(glm5, phase):
    k = glm5.index_topk
    for T in (1, 100, k - 1, k, k + 1, 4 * k, 16 * k, 131072):
        dense = F.layer_flops(glm5, T, phase, moe=True, sparse=False, has_indexer=False)
        sparse = F.layer_flops(glm5, T, phase, moe=True, sparse=True, has_indexer=False)
        # the same keys are attended while T <= k, fewer beyond
        n_dense = T if phase == "decode" else F.keys_per_query(T)
        n_sparse = min(k, T) if phase == "decode" else F.keys_per_query(T, k)
        assert (n_sparse == n_dense) if T <= k else (n_sparse < n_dense)
        if phase == "decode":  # both absorbed: identical work up to k, strictly less beyond
            assert (sparse["attention"] == dense["attention"]) if T <= k else (sparse["attention"] < dense["attention"])
    # training/prefill: the MQA form costs 2 H (2 r_kv + d_r) = 139,264 per pair vs 2 H (d_qk + d_v) = 65,536 for
    # the expanded dense form. With x = T / k, sparse averages k (1 - 1/(2x)) keys and dense T/2, so sparse
    # attention (indexer aside) only wins beyond the root of x^2 - 4.25 x + 2.125 = 0: x = 3.67, T ~ 7,520.
    if phase != "decode":
        win = [T for T in range(k, 16 * k, 16)
               if F.layer_flops(glm5, T, phase, moe=True, sparse=True, has_indexer=False)["attention"]
               < F.layer_flops(glm5, T, phase, moe=True, sparse=False, has_indexer=False)["attention"]]
        x = (4.25 + (4.25 ** 2 - 4 * 2.125) ** 0.5) / 2
        assert x * k - 16 <= win[0] <= x * k + 16, (win[0], x * k)


def test_dsa_costs_more_than_dense_at_4k_training_and_far_less_at_128k(glm5):
    f = {(T, m): F.flops_per_token(glm5, T, "training", m) for T in (4096, 131072) for m in ("dense", "dsa")}
    assert f[4096, "dsa"]["total"] > f[4096, "dense"]["total"]
    assert f[131072, "dsa"]["total"] < 0.5 * f[131072, "dense"]["total"]


@pytest.mark.parametrize("phase", F.PHASES)
@pytest.mark.parametrize("T", [1024, 4096, 131072, 1048576])
def test_indexshare_lies_strictly_between_full_indexers_and_no_indexer(glm52, phase, T):
    full = F.flops_per_token(glm52, T, phase, "dsa")
    shared = F.flops_per_token(glm52, T, phase, "dsa_indexshare")
    none = sum(sum(F.layer_flops(glm52, T, phase, moe=i >= 3, sparse=True, has_indexer=False).values())
               for i in range(glm52.num_hidden_layers))
    main = shared["total"] - shared["lm_head"] - shared["mtp"]
    assert full["total"] > shared["total"] and main > none
    # exactly: each of the 57 shared layers drops one layer's indexer (and its share of the indexer loss)
    idx = (F.layer_flops(glm52, T, phase, moe=True, sparse=True, has_indexer=True)
           ["indexer"] + F.layer_flops(glm52, T, phase, moe=True, sparse=True, has_indexer=True)["indexer_loss"]
           - F.layer_flops(glm52, T, phase, moe=True, sparse=True, has_indexer=False)["indexer_loss"])
    assert full["total"] - shared["total"] == pytest.approx(57 * idx, rel=1e-12)
    assert shared["indexer"] == pytest.approx(21 / 78 * full["indexer"], rel=1e-12)


def test_glm5_has_no_shared_layers_so_indexshare_changes_nothing(glm5):
    for phase in F.PHASES:
        assert F.flops_per_token(glm5, 65536, phase, "dsa") == F.flops_per_token(glm5, 65536, phase, "dsa_indexshare")


def test_dense_mode_has_no_indexer_and_decode_has_no_mtp_by_default(glm5):
    d = F.flops_per_token(glm5, 8192, "training", "dense")
    assert d["indexer"] == d["indexer_loss"] == 0 and d["mtp"] > 0
    assert F.flops_per_token(glm5, 8192, "decode", "dsa")["mtp"] == 0
    two = F.flops_per_token(glm5, 8192, "decode", "dsa", mtp_depth=2)["mtp"]
    assert two == pytest.approx(2 * sum(F.mtp_flops_per_token(glm5, 8192, "decode", "dsa").values()))
    with pytest.raises(ValueError, match="no MTP layer"):
        F.flops_per_token(glm5.replace(num_nextn_predict_layers=0), 8192, "decode", "dsa", mtp_depth=1)
    with pytest.raises(ValueError, match="phase"):
        F.flops_per_token(glm5, 8192, "inference", "dsa")
    with pytest.raises(ValueError, match="mode"):
        F.flops_per_token(glm5, 8192, "decode", "sparse")


def test_cli_prints_the_tables(capsys):
    F.main(["--config", os.path.join(ROOT, "configs", "glm5.py"), os.path.join(ROOT, "configs", "glm52.py"),
            "--context", "4096", "131072", "--breakdown", "dsa"])
    out = capsys.readouterr().out
    assert "| **total (with MTP)** | 753,864,139,008 | 753,329,940,480 |" in out
    assert "## training: GFLOP per token" in out and "## decode: GFLOP per token" in out
    assert "### glm52 dsa decode" in out
