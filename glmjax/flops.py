"""Parameter counts and per-token FLOPs of the GLM-5 family, following glmjax/model exactly (docs/flops.md).

Parameters: `param_counts(cfg)` -> {component: count}; the components are disjoint and sum to the parameter tree
of `GLM(cfg)` (checked against the NNX tree in tests/test_flops.py). `param_counts(cfg, active=True)` counts what
one token uses (K_e of the E routed experts). `total_params(cfg, include_mtp=..., active=...)` sums them.

FLOPs: `flops_per_token(cfg, context, phase, mode)` -> {component: FLOPs per token} with a "total" entry.

Conventions (all explained in docs/flops.md):
  * Only matrix products count, 2 FLOPs per multiply-add. Norms, RoPE, softmax, SiLU, ReLU, top-k selection,
    gathers, routing and the loss softmax are left out (they are O(activations), not O(parameters)).
  * phase "training": one optimizer step's work per trained token = forward + backward = 3 x forward for every
    product on the gradient path. The indexer's top-k scoring has no backward (top-k is not differentiable and the
    indexer reads detached inputs), so it counts 1 x. The indexer's own KL loss (docs/model.md E.3/E.4) is the separate
    component "indexer_loss" (`indexer_loss=False` drops it). MTP runs `cfg.mtp_depth` depths.
    phase "prefill": forward of a whole sequence of length `context`, averaged per token; LM head on the last
    position only (what a prefill before decoding needs). phase "decode": one new token whose cache (itself
    included) holds `context` tokens, absorbed-weight MLA (docs/model.md D.2).
  * Keys per query in training/prefill: causal=True (default) counts only causally visible keys, i.e. the average
    over positions t = 1..T of t keys ((T+1)/2 for dense attention and the indexer) and of min(k, t) keys for
    sparse attention -- the work of a kernel that skips masked blocks. causal=False counts what a masked dense
    einsum computes (T keys per query; min(k, T) gathered rows for sparse attention), which is what glmjax's XLA
    reference code does.
  * modes: "dense" = MLA everywhere (no indexer); "dsa" = every layer has its own indexer (GLM-5);
    "dsa_indexshare" = the config's indexer_types ("shared" layers reuse the previous full layer's top-k and run
    no indexer). The MTP layer always has its own indexer in the DSA modes.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from glmjax.config import ModelConfig

MODES = ("dense", "dsa", "dsa_indexshare")
PHASES = ("training", "prefill", "decode")
PARAM_COMPONENTS = ("embedding", "lm_head", "mla", "indexer", "dense_mlp", "routed_experts", "shared_experts",
                    "router", "norms", "mtp")
MTP_PARAM_COMPONENTS = ("eh_proj", "norms", "mla", "indexer", "routed_experts", "shared_experts", "router")
FLOP_COMPONENTS = ("mla_proj", "attention", "indexer", "indexer_loss", "dense_mlp", "routed_experts",
                   "shared_experts", "router", "lm_head", "mtp")


# =============================================================================================== parameters


def mla_params(cfg: ModelConfig) -> int:
    """q_a_proj, q_a_layernorm, q_b_proj (or q_proj without a query LoRA), kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj (docs/model.md C.2)."""
    D, H, r_q, r_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    d_r, d_n, d_v = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    return (D * r_q + r_q + query_width(cfg) * H * cfg.qk_head_dim + D * (r_kv + d_r) + r_kv
            + r_kv * H * (d_n + d_v) + H * d_v * D)


def query_width(cfg: ModelConfig) -> int:
    """Width of the query input that q_b_proj / the indexer's wq_b read: r_q, or D without a query LoRA."""
    return cfg.q_lora_rank or cfg.hidden_size


def indexer_params(cfg: ModelConfig) -> int:
    """wq_b [r_q, H_I, d_I] (wq [D, H_I, d_I]), wk [D, d_I], k_norm weight + bias [d_I], weights_proj [D, H_I]
    (GLM-5: 9,371,904)."""
    H_I, d_I, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return query_width(cfg) * H_I * d_I + D * d_I + 2 * d_I + D * H_I


def mlp_params(cfg: ModelConfig, width: int) -> int:
    """SwiGLU gate, up, down."""
    return 3 * cfg.hidden_size * width


def moe_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE block: routed experts, shared expert(s), router (gate weight + e_score_correction_bias)."""
    D, E, I_m = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    return {"routed_experts": E * mlp_params(cfg, I_m),
            "shared_experts": mlp_params(cfg, I_m * cfg.n_shared_experts),
            "router": D * E + E}


def mtp_param_counts(cfg: ModelConfig, active: bool = False) -> dict[str, int]:
    """The MTP layer by component (all zero without one): eh_proj; norms = enorm, hnorm, shared_head norm and the
    decoder layer's two norms; and its decoder layer (MLA + own indexer + MoE). Embedding and head are shared."""
    if not cfg.has_mtp:
        return dict.fromkeys(MTP_PARAM_COMPONENTS, 0)
    D = cfg.hidden_size
    moe = _moe_counted(cfg, active)
    return {"eh_proj": 2 * D * D, "norms": 5 * D, "mla": mla_params(cfg), "indexer": indexer_params(cfg), **moe}


def param_counts(cfg: ModelConfig, active: bool = False) -> dict[str, int]:
    """Component -> parameter count of `GLM(cfg)`. Components are disjoint and sum to the whole tree:

    embedding, lm_head; mla (incl. its q_a/kv_a latent norms) and indexer (full layers only, incl. k_norm) over the
    main layers; dense_mlp (layers < first_k_dense_replace); routed_experts, shared_experts, router (+ the
    e_score_correction_bias) over the MoE layers; norms = input/post-attention norms of every main layer + the
    final norm; mtp = the whole MTP layer (see `mtp_param_counts`).
    active=True: what one token uses -- K_e of the E routed experts per MoE layer; everything else in full
    (the embedding row lookup is counted as the whole table, as is usual for "active parameters").
    """
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    n_dense = cfg.first_k_dense_replace
    n_full = cfg.layer_indexer_types.count("full")
    moe = _moe_counted(cfg, active)
    return {
        "embedding": cfg.vocab_size * D,
        "lm_head": D * cfg.vocab_size,
        "mla": L * mla_params(cfg),
        "indexer": n_full * indexer_params(cfg),
        "dense_mlp": n_dense * mlp_params(cfg, cfg.intermediate_size),
        "routed_experts": (L - n_dense) * moe["routed_experts"],
        "shared_experts": (L - n_dense) * moe["shared_experts"],
        "router": (L - n_dense) * moe["router"],
        "norms": 2 * D * L + D,
        "mtp": sum(mtp_param_counts(cfg, active).values()),
    }


def total_params(cfg: ModelConfig, include_mtp: bool = True, active: bool = False) -> int:
    counts = param_counts(cfg, active)
    return sum(v for k, v in counts.items() if include_mtp or k != "mtp")


def _moe_counted(cfg: ModelConfig, active: bool) -> dict[str, int]:
    moe = moe_params(cfg)
    if active:
        moe["routed_experts"] = cfg.num_experts_per_tok * mlp_params(cfg, cfg.moe_intermediate_size)
    return moe


# =============================================================================================== FLOPs
# Building blocks: forward FLOPs per token of one layer's pieces.


def keys_per_query(T: int, limit: int | None = None, causal: bool = True) -> float:
    """Average number of keys one query attends to in a length-T sequence.

    limit=None: dense, t keys at position t; limit=k: sparse, min(k, t) keys. causal=False: every query counts the
    whole row as a masked einsum computes it (T, or min(k, T) gathered rows)."""
    k = T if limit is None else min(limit, T)
    if not causal:
        return float(k)
    # sum_{t=1..T} min(k, t) = k(k+1)/2 + (T-k)k
    return (k * (k + 1) / 2 + (T - k) * k) / T


def mla_proj_flops(cfg: ModelConfig) -> int:
    """q_a_proj, q_b_proj (or q_proj), kv_a_proj_with_mqa, o_proj: the per-token projections every mode and phase
    runs."""
    D, H, r_q, r_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    return 2 * (D * r_q + query_width(cfg) * H * cfg.qk_head_dim + D * (r_kv + cfg.qk_rope_head_dim)
                + H * cfg.v_head_dim * D)


def kv_up_flops(cfg: ModelConfig) -> int:
    """kv_b_proj work per token: expanding the token's latent to per-head K_nope and V (expanded form), or, the same
    count, absorbing W_UK into the query and applying W_UV to the latent output (absorbed / MQA form)."""
    return 2 * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)


def attention_pair_flops(cfg: ModelConfig, form: str) -> int:
    """FLOPs per (query, key) pair, all heads: scores + probabilities x values.

    expanded (dense MLA prefill/training): Q.K over d_qk, P.V over d_v per head;
    absorbed (MQA form: sparse attention, and every decode): scores over the r_kv + d_r latent row, P.V over r_kv."""
    H = cfg.num_attention_heads
    if form == "expanded":
        return 2 * H * (cfg.qk_head_dim + cfg.v_head_dim)
    if form == "absorbed":
        return 2 * H * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    raise ValueError(f"form {form!r}: must be 'expanded' or 'absorbed'")


def attention_flops(cfg: ModelConfig, n_keys: float, form: str) -> float:
    """Attention of one query over n_keys keys, including the kv_b_proj work (kv_up_flops)."""
    return kv_up_flops(cfg) + n_keys * attention_pair_flops(cfg, form)


def indexer_proj_flops(cfg: ModelConfig) -> int:
    """wq_b (from q_resid; wq from x), wk and weights_proj (from x)."""
    H_I, d_I, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return 2 * (query_width(cfg) * H_I * d_I + D * d_I + D * H_I)


def indexer_score_flops(cfg: ModelConfig, n_keys: float) -> float:
    """I[t,s] = sum_h w[t,h] ReLU(q[t,h].k[s]): 2 H_I d_I for the dots + 2 H_I for the weighted head sum, per key."""
    return n_keys * 2 * cfg.index_n_heads * (cfg.index_head_dim + 1)


def mlp_flops(cfg: ModelConfig, width: int) -> int:
    return 2 * mlp_params(cfg, width)


def moe_flops(cfg: ModelConfig) -> dict[str, int]:
    """Routed: K_e SwiGLU experts + the weighted combine (2 K_e D); shared expert; router logits (D x E, f32)."""
    D, K = cfg.hidden_size, cfg.num_experts_per_tok
    return {"routed_experts": K * mlp_flops(cfg, cfg.moe_intermediate_size) + 2 * K * D,
            "shared_experts": mlp_flops(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts),
            "router": 2 * D * cfg.n_routed_experts}


# ----------------------------------------------------------------------------------------------- per layer


def layer_flops(cfg: ModelConfig, context: int, phase: str, *, moe: bool, sparse: bool, has_indexer: bool,
                causal: bool = True, indexer_loss: bool = True) -> dict[str, float]:
    """FLOPs per token of one decoder layer, with the phase's multipliers applied (see module docstring).

    sparse: DSA top-k attention in MQA form (else dense MLA); has_indexer: the layer runs its own indexer
    (only meaningful with sparse=True)."""
    _check(phase=phase)
    T, k = context, cfg.index_topk
    train = phase == "training"
    mult = 3 if train else 1
    out = dict.fromkeys(FLOP_COMPONENTS, 0.0)
    out["mla_proj"] = mult * mla_proj_flops(cfg)

    if phase == "decode":
        n_attn, form = (min(k, T) if sparse else T), "absorbed"
        n_index = T
    else:
        n_attn = keys_per_query(T, k if sparse else None, causal)
        form = "absorbed" if sparse else "expanded"
        n_index = keys_per_query(T, None, causal)
    out["attention"] = mult * attention_flops(cfg, n_attn, form)

    if sparse and has_indexer:
        # top-k path: forward only in every phase (no gradient through top-k, inputs detached)
        out["indexer"] = indexer_proj_flops(cfg) + indexer_score_flops(cfg, n_index)
    if train and sparse and indexer_loss:
        # docs/model.md E.3/E.4 sparse KL: every sparse layer recomputes its (detached) main-attention scores over its
        # selected keys as the target; a layer with an indexer recomputes its index scores over the same keys with
        # forward + backward (3x) and needs weight gradients of its projections (inputs detached: dW only, 1x).
        n_sel = keys_per_query(T, k, causal)
        out["indexer_loss"] = n_sel * 2 * cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        if has_indexer:
            out["indexer_loss"] += 3 * indexer_score_flops(cfg, n_sel) + indexer_proj_flops(cfg)

    if moe:
        for name, v in moe_flops(cfg).items():
            out[name] = mult * v
    else:
        out["dense_mlp"] = mult * mlp_flops(cfg, cfg.intermediate_size)
    return out


def mtp_flops_per_token(cfg: ModelConfig, context: int, phase: str, mode: str, *, causal: bool = True,
                        indexer_loss: bool = True) -> dict[str, float]:
    """One MTP depth per token: eh_proj (2D -> D, counted under mla_proj) + the MTP decoder layer (MoE, own indexer
    in the DSA modes) + the shared LM head (logits at every position in training, one in decode)."""
    _check(phase=phase, mode=mode)
    sparse = mode != "dense"
    out = layer_flops(cfg, context, phase, moe=True, sparse=sparse, has_indexer=sparse, causal=causal,
                      indexer_loss=indexer_loss)
    mult = 3 if phase == "training" else 1
    out["mla_proj"] += mult * 2 * (2 * cfg.hidden_size) * cfg.hidden_size
    out["lm_head"] = mult * _lm_head_flops(cfg, context, phase)
    return out


def mode_indexer_types(cfg: ModelConfig, mode: str) -> tuple[str, ...] | None:
    """Per-layer "full"/"shared" in a mode, None for dense (no indexer, dense attention)."""
    _check(mode=mode)
    if mode == "dense":
        return None
    if mode == "dsa":
        return ("full",) * cfg.num_hidden_layers
    return cfg.layer_indexer_types


def flops_per_token(cfg: ModelConfig, context: int, phase: str = "training", mode: str = "dsa_indexshare", *,
                    causal: bool = True, indexer_loss: bool = True, mtp_depth: int | None = None) -> dict[str, float]:
    """Matmul FLOPs per token, by component (FLOP_COMPONENTS) plus "total".

    context: sequence length T (training / prefill) or cache length incl. the new token (decode).
    mtp_depth: MTP depths run per token; default cfg.mtp_depth in training (0 without an MTP layer), 0 in prefill
    and decode (pass the number of draft steps to count speculative decoding).
    "mtp" holds everything the MTP depths cost (their attention, indexer, experts, head); the other components
    are the main model only."""
    _check(phase=phase, mode=mode)
    if context < 1:
        raise ValueError(f"context={context}: must be >= 1")
    types = mode_indexer_types(cfg, mode)
    out = dict.fromkeys(FLOP_COMPONENTS, 0.0)
    for i in range(cfg.num_hidden_layers):
        layer = layer_flops(cfg, context, phase, moe=i >= cfg.first_k_dense_replace, sparse=types is not None,
                            has_indexer=types is not None and types[i] == "full", causal=causal,
                            indexer_loss=indexer_loss)
        for name, v in layer.items():
            out[name] += v
    out["lm_head"] = (3 if phase == "training" else 1) * _lm_head_flops(cfg, context, phase)
    if mtp_depth is None:
        mtp_depth = cfg.mtp_depth if (phase == "training" and cfg.has_mtp) else 0
    if mtp_depth:
        if cfg.num_nextn_predict_layers == 0:
            raise ValueError(f"mtp_depth={mtp_depth} but the config has no MTP layer (num_nextn_predict_layers=0)")
        out["mtp"] = mtp_depth * sum(mtp_flops_per_token(cfg, context, phase, mode, causal=causal,
                                                         indexer_loss=indexer_loss).values())
    out["total"] = sum(out[name] for name in FLOP_COMPONENTS)
    return out


def attention_only(flops: dict[str, float]) -> float:
    """The mode-dependent part of the main model: attention core (incl. kv_b work) + indexer + indexer loss."""
    return flops["attention"] + flops["indexer"] + flops["indexer_loss"]


def _lm_head_flops(cfg: ModelConfig, context: int, phase: str) -> float:
    per = 2 * cfg.hidden_size * cfg.vocab_size
    return per / context if phase == "prefill" else per


def _check(phase: str | None = None, mode: str | None = None) -> None:
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase {phase!r}: must be one of {PHASES}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode {mode!r}: must be one of {MODES}")


# =============================================================================================== CLI


def load_model_config(path: str) -> ModelConfig:
    """An ML-collections config file with `get_config().model` (e.g. configs/glm5.py) -> ModelConfig."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    root = os.path.dirname(os.path.dirname(path))  # repo root, so `from configs import glm5` resolves
    if root not in sys.path:
        sys.path.insert(0, root)
    name = "_flops_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return ModelConfig.from_dict(module.get_config().model)


def _ctx_label(T: int) -> str:
    return f"{T:,}"


def _g(x: float) -> str:
    """GFLOP with 3 significant-ish digits, thousands separated."""
    g = x / 1e9
    return f"{g:,.0f}" if g >= 100 else (f"{g:.1f}" if g >= 10 else f"{g:.2f}")


def param_table(named: list[tuple[str, ModelConfig]]) -> str:
    head = "| component | " + " | ".join(n for n, _ in named) + " |"
    lines = [head, "|---|" + "---:|" * len(named)]
    counts = [param_counts(c) for _, c in named]
    for comp in PARAM_COMPONENTS:
        lines.append(f"| {comp} | " + " | ".join(f"{c[comp]:,}" for c in counts) + " |")
    rows = [("total (with MTP)", lambda c: total_params(c)),
            ("total without MTP", lambda c: total_params(c, include_mtp=False)),
            ("active per token (with MTP)", lambda c: total_params(c, active=True)),
            ("active per token without MTP", lambda c: total_params(c, include_mtp=False, active=True))]
    for label, fn in rows:
        lines.append(f"| **{label}** | " + " | ".join(f"{fn(c):,}" for _, c in named) + " |")
    return "\n".join(lines)


def comparison_table(named: list[tuple[str, ModelConfig]], contexts: list[int], phase: str,
                     causal: bool = True, indexer_loss: bool = True) -> str:
    """Per-token GFLOP: totals and attention-only (attention + indexer [+ indexer loss]) for the three modes."""
    lines = ["| model | context | dense MLA | DSA | DSA+IndexShare | attn: dense | attn: DSA | attn: DSA+IS "
             "| total dense/DSA | total dense/DSA+IS | attn dense/DSA | attn dense/DSA+IS |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, cfg in named:
        for T in contexts:
            f = {m: flops_per_token(cfg, T, phase, m, causal=causal, indexer_loss=indexer_loss) for m in MODES}
            tot = {m: f[m]["total"] for m in MODES}
            att = {m: attention_only(f[m]) for m in MODES}
            lines.append(
                f"| {name} | {_ctx_label(T)} | " + " | ".join(_g(tot[m]) for m in MODES) + " | "
                + " | ".join(_g(att[m]) for m in MODES) + " | "
                + f"{tot['dense'] / tot['dsa']:.2f} | {tot['dense'] / tot['dsa_indexshare']:.2f} | "
                + f"{att['dense'] / att['dsa']:.2f} | {att['dense'] / att['dsa_indexshare']:.2f} |")
    return "\n".join(lines)


def breakdown_table(cfg: ModelConfig, contexts: list[int], phase: str, mode: str, causal: bool = True,
                    indexer_loss: bool = True) -> str:
    lines = ["| component | " + " | ".join(_ctx_label(T) for T in contexts) + " |",
             "|---|" + "---:|" * len(contexts)]
    fs = [flops_per_token(cfg, T, phase, mode, causal=causal, indexer_loss=indexer_loss) for T in contexts]
    for comp in FLOP_COMPONENTS + ("total",):
        lines.append(f"| {comp} | " + " | ".join(_g(f[comp]) for f in fs) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m glmjax.flops",
                                description="Parameter counts and per-token FLOPs (GFLOP) by component.")
    p.add_argument("--config", nargs="+", required=True, help="config files with get_config().model")
    p.add_argument("--context", nargs="+", type=int, default=[4096, 131072, 202752, 1048576],
                   help="sequence length (training, prefill) / cache length incl. the new token (decode)")
    p.add_argument("--phase", nargs="+", default=["training", "decode"], choices=PHASES)
    p.add_argument("--breakdown", nargs="*", default=None, choices=MODES,
                   help="also print per-component tables for these modes (no value: all modes)")
    p.add_argument("--masked", action="store_true",
                   help="count masked (non-causal) query-key pairs too, as a masked dense einsum computes them")
    p.add_argument("--no-indexer-loss", action="store_true", help="leave the indexer KL loss out of training")
    a = p.parse_args(argv)
    named = [(os.path.splitext(os.path.basename(c))[0], load_model_config(c)) for c in a.config]
    causal, il = not a.masked, not a.no_indexer_loss

    print("## Parameters\n")
    print(param_table(named))
    keys = "causal key counts" if causal else "masked pairs counted"
    what = {"training": f"forward + backward per trained token, {keys}, MTP x mtp_depth, indexer KL loss "
                        f"{'included' if il else 'excluded'}",
            "prefill": f"forward of a whole sequence of length `context`, averaged per token, {keys}",
            "decode": "one new token attending to a cache of `context` tokens, absorbed MLA"}
    for phase in a.phase:
        print(f"\n## {phase}: GFLOP per token ({what[phase]})\n")
        print(comparison_table(named, a.context, phase, causal, il))
    if a.breakdown is not None:
        for name, cfg in named:
            for mode in (a.breakdown or MODES):
                for phase in a.phase:
                    print(f"\n### {name} {mode} {phase}: GFLOP per token by component\n")
                    print(breakdown_table(cfg, a.context, phase, mode, causal, il))


if __name__ == "__main__":
    main()
