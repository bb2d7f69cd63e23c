"""HF interop against transformers (CPU torch, float32): logit and per-layer top-k parity for GlmMoeDsaForCausalLM
(Full + Shared layers, MTP) and DeepseekV32ForCausalLM (half-split indexer RoPE, YaRN, n_group > 1), a wrong-RoPE
negative control, bit-exact export(import(x)), named errors, FP8 dequantisation, sharded import, the CLI and the RoPE
flags transformers ignores (docs/model.md F-1)."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from glmjax.config import ModelConfig  # noqa: E402
from glmjax.interop import (HFCheckpointError, config_from_hf, config_to_hf, dequantize_fp8, load_hf,  # noqa: E402
                            logical_sharding, save_hf)
from glmjax.cli import hf as hf_cli  # noqa: E402
from glmjax.interop import hf as hf_mod  # noqa: E402
from glmjax.model import Batch  # noqa: E402
from glmjax.model.backends import XLA  # noqa: E402
from glmjax.model.indexer import index_logits  # noqa: E402

S = 48  # > index_topk: the indexer really selects (docs/model.md A.5 rule 1)
# docs/model.md A.5 tiny config, except index_n_heads=32 (GLM-5's value): with 4 indexer heads a key scores exactly 0.0
# whenever all 4 ReLUs clip (p = 1/16), and those exact ties are broken differently by torch.topk and lax.top_k.
GLM_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    scoring_func="sigmoid", topk_method="noaux_tc", index_n_heads=32, index_head_dim=32, index_topk=8,
    indexer_types=["full", "full", "shared", "shared", "full", "shared"], indexer_rope_interleave=True,
    rope_interleave=True, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    max_position_embeddings=256, rms_norm_eps=1e-5, num_nextn_predict_layers=1, tie_word_embeddings=False,
    attention_bias=False)
DS_TINY = {k: v for k, v in GLM_TINY.items() if k not in ("indexer_types", "indexer_rope_interleave",
                                                          "rope_interleave")}
DS_TINY.update(rms_norm_eps=1e-6, rope_parameters={
    "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


# ------------------------------------------------------------------------------------------- fixtures


def randomize(module: torch.nn.Module, seed: int):
    """Unit-scale random weights (so logits are O(1)); norms ~ 1 +- 0.1, LayerNorm biases and the router
    correction bias small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return module


def hf_classes(kind):
    if kind == "glm":
        return (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM,
                transformers.models.glm_moe_dsa.modeling_glm_moe_dsa)
    return (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM,
            transformers.models.deepseek_v32.modeling_deepseek_v32)


def hf_config(kind, **kw):
    cls = hf_classes(kind)[0]
    cfg = cls(**{**(GLM_TINY if kind == "glm" else DS_TINY), **kw})
    cfg._attn_implementation = "eager"
    return cfg


def file_layout(state: dict, prefix: str) -> dict:
    """A transformers module state dict (fused experts) -> hub checkpoint tensors (per-expert) under prefix."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :half].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, half:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[prefix + k] = v.detach().clone()
    return out


class MTPRef(torch.nn.Module):
    """The MTP block of docs/model.md B.11 from transformers pieces: enorm, hnorm, eh_proj, decoder layer N,
    shared_head."""

    def __init__(self, kind, seed):
        super().__init__()
        cfg_cls, _, mod = hf_classes(kind)
        n = GLM_TINY["num_hidden_layers"]
        extra = {"indexer_types": GLM_TINY["indexer_types"] + ["full"]} if kind == "glm" else {}
        cfg = hf_config(kind, num_hidden_layers=n + 1, **extra)
        norm = mod.GlmMoeDsaRMSNorm if kind == "glm" else mod.DeepseekV32RMSNorm
        layer = mod.GlmMoeDsaDecoderLayer if kind == "glm" else mod.DeepseekV32DecoderLayer
        D = cfg.hidden_size
        self.kind = kind
        self.enorm, self.hnorm = norm(D, cfg.rms_norm_eps), norm(D, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
        self.layer = layer(cfg, n)
        self.shared_head_norm = norm(D, cfg.rms_norm_eps)
        randomize(self, seed)

    def tensors(self, prefix):
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith(("layer.", "shared_head_norm."))}
        out = file_layout(sd, prefix)
        out.update(file_layout({k[len("layer."):]: v for k, v in self.state_dict().items()
                                if k.startswith("layer.")}, prefix))
        out[prefix + "shared_head.norm.weight"] = self.shared_head_norm.weight.detach().clone()
        return out

    def forward(self, emb, h, rotary):
        S_ = emb.shape[1]
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        pos = torch.arange(S_)[None]
        mask = torch.full((S_, S_), torch.finfo(torch.float32).min).triu(1)[None, None].expand(emb.shape[0], 1, S_, S_)
        out = self.layer(u, attention_mask=mask, position_ids=pos, position_embeddings=rotary(u, pos))
        return self.shared_head_norm(out[0] if isinstance(out, tuple) else out)


def save_ckpt(path, tensors: dict, config: dict):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def build(kind, root, seed):
    """Random HF model, saved with save_pretrained (no MTP: transformers drops layer N) and a copy with injected
    MTP tensors (DeepSeek: plus its private embed_tokens / shared_head.head copies)."""
    _, model_cls, _ = hf_classes(kind)
    torch.manual_seed(seed)
    model = randomize(model_cls(hf_config(kind)).float().eval(), seed)
    plain = os.path.join(root, f"{kind}_plain")
    model.save_pretrained(plain)
    mtp = MTPRef(kind, seed + 1).eval()
    n = GLM_TINY["num_hidden_layers"]
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    tensors.update(mtp.tensors(f"model.layers.{n}."))
    if kind == "ds":
        tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    with open(os.path.join(plain, "config.json")) as f:
        config = json.load(f)
    full = os.path.join(root, f"{kind}_mtp")
    save_ckpt(full, tensors, config)
    return model, mtp, plain, full


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {"glm": build("glm", root, 0), "ds": build("ds", root, 10), "root": root}


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, GLM_TINY["vocab_size"], (2, S)).astype(np.int32)


def batch_of(tok):
    B, S_ = tok.shape
    return Batch(jnp.asarray(tok), jnp.ones((B, S_), jnp.int32), jnp.broadcast_to(jnp.arange(S_, dtype=jnp.int32),
                                                                                    (B, S_)))


# ---------------------------------------------------------------------------------------- parity checks


def hf_forward(model, tok):
    """-> logits [B,S,V], per-layer top-k indices actually used (shared layers: the previous full layer's)."""
    full = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, i, o: full.append(o.numpy()))
             for layer in model.model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    with torch.no_grad():
        logits = model(torch.tensor(tok, dtype=torch.long)).logits.numpy()
    for h in hooks:
        h.remove()
    used, it = [], iter(full)
    for layer in model.model.layers:
        used.append(next(it) if getattr(layer.self_attn, "indexer", None) is not None else used[-1])
    return logits, used


def ours_forward(model, tok):
    """-> logits, per-layer indices used [B,S,k'] (-1 = none), per-layer index scores [B,S,T] of the full layer
    that produced them. Layers unrolled (scan_layers=False) so each layer's values can be returned from the jit; a
    recording XLA backend sees what each layer selects and attends to."""
    used, qkw = [], []

    def rec_sparse(q, kv, idx, **kw):
        used.append(idx)
        return XLA.sparse_mla(q, kv, idx, **kw)

    def rec_topk(q, k, w, *a, **kw):
        qkw.append((q, k, w))
        return XLA.index_topk(q, k, w, *a, **kw)

    recording = XLA._replace(index_topk=rec_topk, sparse_mla=rec_sparse)

    @nnx.jit
    def run(m, b):
        used.clear()
        qkw.clear()
        h, _ = m(b, "sparse", backend=recording)
        return m.logits(h), list(used), [index_logits(*a) for a in qkw]

    logits, ids, scores = run(model, batch_of(tok))
    types = model.cfg.layer_indexer_types
    per_layer, it = [], iter(scores)
    for t in types:
        per_layer.append(np.asarray(next(it)) if t == "full" else per_layer[-1])
    return np.asarray(logits), [np.asarray(i) for i in ids], per_layer


def topk_mismatches(ours, hf, scores):
    """Rows (b, t) whose selected sets differ other than by exact ties at the k-th score. HF's indices past t
    (masked keys chosen when fewer than k are visible) are dropped; ours marks those slots -1."""
    bad = []
    for b in range(ours.shape[0]):
        for t in range(ours.shape[1]):
            mine = set(ours[b, t][ours[b, t] >= 0].tolist())
            theirs = {x for x in hf[b, t].tolist() if x <= t}
            if mine == theirs:
                continue
            kth = min(scores[b, t, x] for x in mine) if mine else None
            if len(mine) != len(theirs) or any(scores[b, t, x] != kth for x in mine ^ theirs):
                bad.append((b, t))
    return bad


def assert_parity(model, hf_model, tok):
    ref, hf_used = hf_forward(hf_model, tok)
    logits, used, scores = ours_forward(model, tok)
    assert len(used) == len(hf_used) == model.cfg.num_hidden_layers
    for i, (u, h, s) in enumerate(zip(used, hf_used, scores)):
        assert not topk_mismatches(u, h, s), f"layer {i}: top-k sets differ"
    err = float(np.max(np.abs(logits - ref)))
    assert err < 1e-4, err
    return err


@pytest.mark.slow
def test_glm_parity_full_and_shared_layers(ckpts, tokens):
    hf_model, _, _, path = ckpts["glm"]
    model, layout = load_hf(path, overrides={"scan_layers": False})
    assert model.cfg.layer_indexer_types == ("full", "full", "shared", "shared", "full", "shared")
    assert model.cfg.latent_norm_eps == 1e-6 and model.cfg.rms_norm_eps == 1e-5  # HF's q_a/kv_a eps (docs/model.md F-4)
    assert model.stacks[1].units.layers[1].self_attn.indexer is None
    err = assert_parity(model, hf_model, tokens)
    print(f"glm_moe_dsa max |logit diff| = {err:.2e}")


@pytest.mark.slow
def test_dsv32_parity_halfsplit_indexer_yarn_groups(ckpts, tokens):
    hf_model, _, _, path = ckpts["ds"]
    model, _ = load_hf(path, overrides={"scan_layers": False})
    cfg = model.cfg
    assert not cfg.indexer_rope_interleave and cfg.rope_interleave and cfg.yarn and cfg.n_group == 4
    assert set(cfg.layer_indexer_types) == {"full"}
    err = assert_parity(model, hf_model, tokens)
    print(f"deepseek_v32 max |logit diff| = {err:.2e}")


def test_wrong_indexer_rope_layout_fails_the_topk_check(ckpts, tokens):
    hf_model, _, _, path = ckpts["glm"]
    model, _ = load_hf(path, overrides={"scan_layers": False, "indexer_rope_interleave": False})
    ref, hf_used = hf_forward(hf_model, tokens)
    logits, used, scores = ours_forward(model, tokens)
    bad = [len(topk_mismatches(u, h, sc)) for u, h, sc in zip(used, hf_used, scores)]
    assert bad[0] > 0  # already layer 0 selects differently
    err = float(np.max(np.abs(logits - ref)))
    assert err > 1e-2
    print(f"wrong indexer RoPE: mismatching rows per layer {bad} of {2 * S}, max |logit diff| {err:.2f}")


def test_mtp_layer_matches_transformers_pieces(ckpts, tokens):
    hf_model, mtp_ref, _, path = ckpts["glm"]
    model, layout = load_hf(path)
    assert model.mtp is not None and not layout.copies
    nxt = np.roll(tokens, -1, axis=1)
    with torch.no_grad():
        # post-norm (docs/model.md B.11)
        h_hf = hf_model.model(torch.tensor(tokens, dtype=torch.long)).last_hidden_state
        emb = hf_model.model.embed_tokens(torch.tensor(nxt, dtype=torch.long))
        ref = hf_model.lm_head(mtp_ref(emb, h_hf, hf_model.model.rotary_emb)).numpy()

    @nnx.jit
    def run(m, b, nxt):
        h, _ = m(b, "sparse")
        hk, _, _ = m.mtp(m.embed_tokens[...][nxt], h, m.ctx(b, "sparse"), jnp.float32)
        return m.logits(hk)

    out = np.asarray(run(model, batch_of(tokens), jnp.asarray(nxt)))
    err = float(np.max(np.abs(out - ref)))
    assert err < 1e-4
    print(f"MTP max |logit diff| = {err:.2e}")


def test_no_mtp_tensors_builds_no_mtp_layer(ckpts):
    _, _, plain, _ = ckpts["glm"]
    model, layout = load_hf(plain)
    assert model.mtp is None and model.cfg.num_nextn_predict_layers == 0
    assert any("no model.layers.6" in n for n in layout.notes)
    _, layout = load_hf(plain, overrides={"param_dtype": "bfloat16"})  # f32 source into bf16 params
    assert any("rounded to param_dtype=bfloat16" in n for n in layout.notes)


# -------------------------------------------------------------------------------------------- round trip


def assert_same_tensors(a_dir, b_dir):
    def tensors(d):
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, f)))
        return out

    a, b = tensors(a_dir), tensors(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().flatten().view(torch.uint8),
                           b[k].contiguous().flatten().view(torch.uint8)), k


def to_bf16(src, dst):
    t = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16))
         for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    with open(os.path.join(src, "config.json")) as f:
        save_ckpt(dst, t, {**json.load(f), "dtype": "bfloat16"})


def to_fused(src, dst):
    """Per-expert -> transformers-v5 fused experts (gate_up_proj [E, 2I, D], down_proj [E, D, I])."""
    t = load_file(os.path.join(src, "model.safetensors"))
    out, layers = {}, {}
    for k, v in t.items():
        if ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, name = rest.split(".")[:2]
            layers.setdefault(pre, {}).setdefault(name, {})[int(e)] = v
        else:
            out[k] = v
    for pre, d in layers.items():
        E = len(d["gate_proj"])
        out[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([d["gate_proj"][e], d["up_proj"][e]]) for e in range(E)])
        out[f"{pre}.mlp.experts.down_proj"] = torch.stack([d["down_proj"][e] for e in range(E)])
    with open(os.path.join(src, "config.json")) as f:
        save_ckpt(dst, out, json.load(f))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["glm_f32", "glm_bf16", "glm_fused", "ds_copies"])
def test_export_of_import_is_bit_exact(ckpts, tmp_path, variant):
    src = ckpts["ds" if variant == "ds_copies" else "glm"][3]
    if variant == "glm_bf16":
        to_bf16(src, str(tmp_path / "src"))
        src = str(tmp_path / "src")
    elif variant == "glm_fused":
        to_fused(src, str(tmp_path / "src"))
        src = str(tmp_path / "src")
    model, layout = load_hf(src)
    if variant == "glm_fused":
        assert set(layout.expert_layouts.values()) == {"fused"}
    if variant == "ds_copies":
        assert sorted(layout.copies) == ["model.layers.6.embed_tokens.weight", "model.layers.6.shared_head.head.weight"]
        assert any("identical copy" in n for n in layout.notes)
    out = str(tmp_path / "out")
    files = save_hf(model, out, layout, max_shard_size="300KB")
    assert len(files) > 3 and "model.safetensors.index.json" in files  # several shards + index
    assert_same_tensors(src, out)
    with open(os.path.join(out, "config.json")) as f, open(os.path.join(src, "config.json")) as g:
        assert json.load(f) == json.load(g)
    model2, layout2 = load_hf(out)  # multi-shard import through the index
    out2 = str(tmp_path / "out2")
    save_hf(model2, out2, layout2)
    assert_same_tensors(src, out2)
    with pytest.raises(FileExistsError):
        save_hf(model2, out2, layout2)  # never overwrites a checkpoint silently


def test_exported_checkpoint_loads_in_transformers(ckpts, tokens, tmp_path):
    hf_model, _, plain, _ = ckpts["glm"]
    model, _ = load_hf(plain)
    out = str(tmp_path / "out")
    save_hf(model, out, None, dtype="F32")  # no layout: generated config.json, canonical order
    reloaded = transformers.GlmMoeDsaForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    with torch.no_grad():
        a = hf_model(torch.tensor(tokens, dtype=torch.long)).logits
        b = reloaded(torch.tensor(tokens, dtype=torch.long)).logits
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ errors


def edited(src, dst, edit):
    t = load_file(os.path.join(src, "model.safetensors"))
    edit(t)
    with open(os.path.join(src, "config.json")) as f:
        save_ckpt(dst, t, json.load(f))
    return dst


def test_missing_misshaped_and_unexpected_tensors_are_all_named(ckpts, tmp_path):
    src = ckpts["glm"][3]
    removed = "model.layers.1.self_attn.q_b_proj.weight"
    bad = edited(src, str(tmp_path / "a"), lambda t: t.pop(removed))
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.1\.self_attn\.q_b_proj\.weight") as e:
        load_hf(bad)
    assert e.value.missing == [removed] and not e.value.unexpected and not e.value.mismatched

    shaped = "model.layers.4.self_attn.indexer.wk.weight"
    bad = edited(src, str(tmp_path / "b"), lambda t: t.__setitem__(shaped, t[shaped].T.contiguous()))
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.4\.self_attn\.indexer\.wk\.weight: shape \[128, 32\]"):
        load_hf(bad)

    def several(t):
        t.pop(removed)
        t.pop("model.layers.6.mlp.experts.3.up_proj.weight")
        t[shaped] = t[shaped][:, :7].contiguous()
        t["model.layers.2.self_attn.foo.weight"] = torch.zeros(2)
    bad = edited(src, str(tmp_path / "c"), several)
    with pytest.raises(HFCheckpointError) as e:
        hf_mod.check_hf(bad)  # names only, nothing loaded
    assert e.value.missing == [removed, "model.layers.6.mlp.experts.3.up_proj.weight"]
    assert e.value.unexpected == ["model.layers.2.self_attn.foo.weight"]
    assert len(e.value.mismatched) == 1 and e.value.mismatched[0].startswith(shaped)
    msg = str(e.value)
    assert all(k in msg for k in (removed, shaped, "foo.weight", "experts.3.up_proj"))


def test_shared_layer_indexer_weights_are_ignored_with_a_note(ckpts, tmp_path):
    """5.0/5.1-style weights (every layer has an indexer) under a shared schedule: loaded model identical."""
    src = ckpts["glm"][3]

    def add_indexers(t):
        for i in (2, 3, 5):
            for k in [k for k in t if k.startswith("model.layers.1.self_attn.indexer.")]:
                t[k.replace("layers.1.", f"layers.{i}.")] = t[k].clone()
    path = edited(src, str(tmp_path / "c"), add_indexers)
    ref, _ = load_hf(src)
    model, layout = load_hf(path)
    assert len(layout.ignored) == 15 and any("IndexShare 'shared' layer" in n for n in layout.notes)
    for a, b in zip(jax.tree.leaves(nnx.state(ref)), jax.tree.leaves(nnx.state(model))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------------- FP8


def test_fp8_dequantisation_hand_computed_case():
    import ml_dtypes
    w = np.array([[1, 2, -0.5], [448, -3, 0.25]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    s = np.array([[2, 0.5], [0.125, 4]], np.float32)
    out = dequantize_fp8(w, s, (1, 2))  # blocks of 1 row x 2 columns
    np.testing.assert_array_equal(out, np.array([[2, 4, -0.25], [56, -0.375, 1.0]], np.float32))


FP8_SKIP = ("norm", "mlp.gate.weight", "weights_proj", "lm_head", "embed_tokens", "e_score_correction_bias")


def fp8_checkpoint(src: str, path: str) -> dict:
    """The checkpoint at src with every 2-D linear weight except the docs/model.md C.4 exceptions as float8 e4m3 +
    [128,128] block weight_scale_inv, saved to path -> {key: the hand (block by block) dequantisation, f32}."""
    import ml_dtypes
    t = load_file(os.path.join(src, "model.safetensors"))
    out, ref = {}, {}
    for k, v in t.items():
        if v.ndim != 2 or any(s in k for s in FP8_SKIP):
            out[k] = v
            continue
        w = v.numpy()
        ob, ib = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        scale = np.zeros((ob, ib), np.float32)
        q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
        for i in range(ob):
            for j in range(ib):
                blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                scale[i, j] = np.abs(blk).max() / 448.0
                q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / scale[i, j]).astype(q.dtype)
        deq = np.empty(w.shape, np.float32)  # reference dequantisation, block by block
        for i in range(ob):
            for j in range(ib):
                rs, cs = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
                deq[rs, cs] = q[rs, cs].astype(np.float32) * scale[i, j]
        ref[k] = deq
        out[k] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        out[k[:-len("weight")] + "weight_scale_inv"] = torch.from_numpy(scale)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    save_ckpt(path, out, config)
    return ref


def test_fp8_block_scaled_checkpoint(ckpts, tmp_path):
    import ml_dtypes
    path = str(tmp_path / "fp8")
    ref = fp8_checkpoint(ckpts["glm"][3], path)
    model, layout = load_hf(path)
    assert sorted(layout.dequantized) == sorted(ref)
    exp = str(tmp_path / "exp")
    save_hf(model, exp, layout, dtype="F32")
    got = load_file(os.path.join(exp, "model.safetensors"))
    assert not any(k.endswith("weight_scale_inv") for k in got)
    for k, v in ref.items():  # exported dequantised (bf16): equals the hand result rounded to bf16
        assert got[k].dtype == torch.bfloat16
        np.testing.assert_array_equal(got[k].float().numpy(), v.astype(ml_dtypes.bfloat16).astype(np.float32))
    q_b = np.asarray(model.stacks[1].units.layers[0].self_attn.q_b_proj[...][0])  # layer 1 -> [r_q, H, d_qk]
    np.testing.assert_array_equal(q_b, ref["model.layers.1.self_attn.q_b_proj.weight"].T.reshape(q_b.shape))
    with open(os.path.join(exp, "config.json")) as f:
        assert "quantization_config" not in json.load(f)


# ------------------------------------------------------------------------------------ sharding, CLI, config


def test_sharded_import_and_export(ckpts, tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rules = {"vocab": "model", "embed": "data", "experts": "model", "heads": "model", "index_heads": "model"}
    path = ckpts["glm"][3]
    ref, _ = load_hf(path)
    model, layout = load_hf(path, sharding=logical_sharding(mesh, rules))
    P = jax.sharding.PartitionSpec
    assert model.embed_tokens[...].sharding.spec == P("model", "data")
    gate = model.stacks[1].units.layers[0].mlp.experts_gate[...]
    assert gate.sharding.spec == P(None, "model", "data", None) and len(gate.addressable_shards) == 8
    for a, b in zip(jax.tree.leaves(nnx.state(ref)), jax.tree.leaves(nnx.state(model))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    save_hf(model, str(tmp_path / "out"), layout)
    assert_same_tensors(path, str(tmp_path / "out"))


def test_mtp_copy_that_differs_is_reported(ckpts, tmp_path):
    src = ckpts["ds"][3]
    key = "model.layers.6.shared_head.head.weight"
    path = edited(src, str(tmp_path / "d"), lambda t: t[key].__setitem__((3, 5), t[key][3, 5] + 0.5))
    model, layout = load_hf(path)
    assert key in layout.copies and any(n.startswith(key + " differs") and "0.5" in n for n in layout.notes)


@pytest.mark.parametrize("name, tensors, params", [
    ("glm5", 59870, 753_864_139_008),  # GLM-5.1 BF16 checkpoint listing, docs/model.md A.1 / S9
    ("glm52", 59870 - 57 * 5, 753_864_139_008 - 57 * 9_371_904),  # shared layers carry no indexer (docs/model.md A.2)
    ("deepseek_v32", 46491 + 2, 685_355_329_792),  # + layer-61 embed/head copies: 685.4B (docs/model.md A.3)
])
def test_key_map_of_the_real_configs(name, tensors, params):
    import importlib
    cfg = ModelConfig.from_dict(importlib.import_module(f"configs.{name}").get_config().model.to_dict())
    _, leaves = hf_mod._abstract_model(cfg)  # abstract: nothing allocated
    specs = hf_mod.plan_keys(cfg, {p: tuple(v.shape) for p, v in leaves.items()}, {})
    copies = ([s.shape for k, s in specs.items() if k in ("model.embed_tokens.weight", "lm_head.weight")]
              if name == "deepseek_v32" else [])
    assert len(specs) + len(copies) == tensors
    assert sum(math.prod(s.shape) for s in specs.values()) + sum(math.prod(c) for c in copies) == params
    if name == "glm5":
        assert specs["model.layers.78.self_attn.q_b_proj.weight"].shape == (16384, 2048)
        assert specs["model.layers.78.eh_proj.weight"].shape == (6144, 12288)
        assert specs["model.layers.77.mlp.experts.255.down_proj.weight"].shape == (6144, 2048)


def test_cli_import_export_roundtrip(ckpts, tmp_path, capsys):
    src = ckpts["ds"][3]
    assert hf_cli.main(["inspect", src]) == 0
    assert '"indexer_rope_interleave": false' in capsys.readouterr().out
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    assert hf_cli.main(["import", src, ck]) == 0
    assert sorted(os.listdir(ck)) == ["hf_layout.json", "model_config.json", "state"]
    assert hf_cli.main(["export", ck, out, "--max-shard-size", "1MB"]) == 0
    assert_same_tensors(src, out)


def test_config_mapping():
    base = {**GLM_TINY, "model_type": "glm_moe_dsa"}
    base.pop("indexer_types")
    cfg, _ = config_from_hf({**base, "num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3})
    t = cfg.layer_indexer_types
    # GLM-5.2 (docs/model.md B.8)
    assert "".join(x[0].upper() for x in t[:10]) == "FFFSSSFSSS" and t.count("full") == 21
    cfg, _ = config_from_hf(base)
    assert set(cfg.layer_indexer_types) == {"full"}  # GLM-5 / 5.1: no schedule fields -> every layer full
    legacy = {**DS_TINY, "model_type": "deepseek_v32", "rope_theta": 1e4,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    legacy.pop("rope_parameters")
    a, _ = config_from_hf(legacy)
    b, _ = config_from_hf({**DS_TINY, "model_type": "deepseek_v32"})
    assert a == b and a.yarn and a.softmax_scale == pytest.approx(48 ** -0.5 * (0.1 * math.log(4) + 1) ** 2)
    assert config_from_hf(config_to_hf(b, "deepseek_v32"))[0] == b
    g, _ = config_from_hf({**GLM_TINY, "model_type": "glm_moe_dsa"}, latent_norm_eps=None)
    assert g.latent_norm_eps == 1e-5 and config_from_hf(config_to_hf(g), latent_norm_eps=None)[0] == g
    with pytest.raises(Exception, match=r"hidden_act='gelu'.*tie_word_embeddings=True"):
        config_from_hf({**base, "hidden_act": "gelu", "tie_word_embeddings": True})
    assert isinstance(g, ModelConfig)


# ------------------------------------------------------------------------------------ RoPE flags (F-1)


def with_config(src, dst, **fields):
    """A copy of checkpoint dir src whose config.json has `fields` set."""
    os.makedirs(dst)
    os.symlink(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = {**json.load(f), **fields}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("kind, flag", [("glm", "rope_interleave"), ("glm", "indexer_rope_interleave"),
                                        ("ds", "rope_interleave"), ("ds", "indexer_rope_interleave")])
def test_rope_flags_transformers_ignores_are_ignored_with_a_warning(ckpts, tokens, tmp_path, caplog, kind, flag):
    plain = ckpts[kind][2]
    mt = "glm_moe_dsa" if kind == "glm" else "deepseek_v32"
    used = hf_mod.keymap.HF_ROPE_LAYOUT[mt][flag]
    path = with_config(plain, str(tmp_path / "flipped"), **{flag: not used})
    reloaded = hf_classes(kind)[1].from_pretrained(path, attn_implementation="eager").float().eval()
    with torch.no_grad():
        ref = reloaded(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    with caplog.at_level("INFO", logger="glmjax.interop"):
        model, layout = load_hf(path, overrides={"scan_layers": False})
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"{flag}={not used}" in warned[0] and f"using {used}" in warned[0], warned
    assert "transformers 5.24 ignores it" in warned[0]
    assert getattr(model.cfg, flag) == used
    err = float(np.max(np.abs(ours_forward(model, tokens)[0] - ref)))
    assert err < 1e-5, err
    # export with the layout writes the source config.json back: transformers reads it to the same logits
    out = str(tmp_path / "out")
    save_hf(model, out, layout)
    again = hf_classes(kind)[1].from_pretrained(out, attn_implementation="eager").float().eval()
    with torch.no_grad():
        assert np.array_equal(again(torch.tensor(tokens, dtype=torch.long)).logits.numpy(), ref)
    # opting in honours the file's flag: no warning, a different model than transformers'
    caplog.clear()
    with caplog.at_level("INFO", logger="glmjax.interop"):
        honoured, _ = load_hf(path, honour_rope_flags=True, overrides={"scan_layers": False})
    assert getattr(honoured.cfg, flag) == (not used)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert float(np.max(np.abs(ours_forward(honoured, tokens)[0] - ref))) > 1e-2


@pytest.mark.parametrize("kind", ["glm", "ds"])
def test_rope_flags_at_transformers_values_give_no_warning(ckpts, tmp_path, caplog, kind):
    mt = "glm_moe_dsa" if kind == "glm" else "deepseek_v32"
    path = with_config(ckpts[kind][2], str(tmp_path / "explicit"), **hf_mod.keymap.HF_ROPE_LAYOUT[mt])
    with caplog.at_level("INFO", logger="glmjax.interop"):
        cfg, _ = hf_mod.check_hf(path)
        assert config_from_hf(config_to_hf(cfg, mt))[0] == cfg
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    with caplog.at_level("INFO", logger="glmjax.interop"):
        config_to_hf(cfg.replace(rope_interleave=False), mt)  # a layout transformers cannot compute
    assert any("rope_interleave=False" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
