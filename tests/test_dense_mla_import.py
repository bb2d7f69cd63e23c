"""Importing a dense MLA checkpoint (transformers' `deepseek_v3`: DeepSeek-V3 / V3.1, Kimi-K2, Moonlight; and
`deepseek_v2` with its softmax router) into a DSA model (issue 43): in dense mode the import reproduces
DeepseekV3ForCausalLM's logits (both RoPE layouts, which deepseek_v3 reads from config.json) and decodes as it
prefills; every layer's lightning indexer is fresh, the model's own initialiser; a deliberately wrong key map fails
the check; export writes `deepseek_v32` with the indexers, which DeepseekV32ForCausalLM loads to glmjax's sparse
logits."""
import json
import os

import numpy as np
import pytest
from flax import nnx, traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from glmjax.infer import Decoder  # noqa: E402
from glmjax.interop import keymap, load_hf, save_hf  # noqa: E402
from glmjax.model import GLM  # noqa: E402
from test_interop import (DS_TINY, S, batch_of, hf_forward, ours_forward, randomize,  # noqa: E402
                          topk_mismatches)

V3_TINY = {k: v for k, v in DS_TINY.items() if not k.startswith("index")}  # no indexer in a deepseek_v3 config
INDEXER = dict(index_n_heads=32, index_head_dim=32, index_topk=8)  # the fresh indexers' shape (--set on the CLI)


V2_TINY = {k: v for k, v in V3_TINY.items() if k not in ("scoring_func", "topk_method", "norm_topk_prob")}


def build_hf(family, path, seed, **kw):
    """A random tiny DeepseekV3ForCausalLM ("v3") or DeepseekV2ForCausalLM ("v2"), saved by transformers to path."""
    name = {"v3": "DeepseekV3", "v2": "DeepseekV2"}[family]
    cfg = getattr(transformers, name + "Config")(**{**(V3_TINY if family == "v3" else V2_TINY), **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize(getattr(transformers, name + "ForCausalLM")(cfg).float().eval(), seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """{rope_interleave: (transformers model, its save_pretrained directory)}."""
    root = tmp_path_factory.mktemp("dense_mla")
    return {inter: (build_hf("v3", str(root / f"v3_{inter}"), 3 + inter, rope_interleave=inter),
                    str(root / f"v3_{inter}")) for inter in (True, False)}


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, V3_TINY["vocab_size"], (2, S)).astype(np.int32)


def hf_logits(model, tok):
    with torch.no_grad():
        return model(torch.tensor(tok, dtype=torch.long)).logits.numpy()


def dense_logits(model, tok):
    h, _ = nnx.jit(lambda m, b: m(b, "dense"))(model, batch_of(tok))
    return np.asarray(model.logits(h))


@pytest.mark.parametrize("inter", [True, False])
def test_deepseek_v3_import_reproduces_transformers_in_dense_mode(v3, tokens, inter):
    hf_model, path = v3[inter]
    model, layout = load_hf(path, overrides=INDEXER)
    cfg = model.cfg
    assert layout.model_type == "deepseek_v3" and cfg.rope_interleave == inter  # deepseek_v3 reads the flag
    assert set(cfg.layer_indexer_types) == {"full"} and not cfg.indexer_rope_interleave and cfg.yarn
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 32, 8)
    assert any("fresh lightning indexer" in n for n in layout.notes)
    assert any(n.startswith("30 indexer tensors") and "fresh" in n for n in layout.notes)  # 6 layers x 5
    err = float(np.max(np.abs(dense_logits(model, tokens) - hf_logits(hf_model, tokens))))
    assert err < 1e-4, err


def test_the_fresh_indexers_are_the_model_initialiser_and_the_rest_the_checkpoint(v3):
    _, path = v3[True]
    model, _ = load_hf(path, overrides=INDEXER)
    ours = traverse_util.flatten_dict(nnx.state(model).to_pure_dict())
    init = traverse_util.flatten_dict(nnx.state(GLM(model.cfg, nnx.Rngs(0))).to_pure_dict())
    indexer = [k for k in ours if "indexer" in k]
    assert len(indexer) == 10  # 5 parameters x 2 stacks (the dense first layer, the MoE layers)
    for k in indexer:  # the same random bits; jitted and eager sampling round the last float bit differently
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(init[k]), rtol=1e-6, atol=0, err_msg=str(k))
    for k in (("embed_tokens",), ("lm_head",)):  # the checkpoint's weights elsewhere
        assert not np.allclose(np.asarray(ours[k]), np.asarray(init[k]))


@pytest.mark.parametrize("family", ["v3", "v2", "v2_lite"])
def test_the_import_decodes_as_transformers_prefills(family, tokens, request):
    """Prefill 24 tokens, then 12 teacher-forced decode steps on the MLA latent cache: every step's logits equal
    transformers' full forward at that position (dense attention; deepseek_v3, deepseek_v2's group-limited
    softmax router, and DeepSeek-V2-Lite's MLA without a query LoRA)."""
    hf_model, path = {"v3": lambda: request.getfixturevalue("v3")[True],
                      "v2": lambda: request.getfixturevalue("v2")["group_limited_greedy"],
                      "v2_lite": lambda: request.getfixturevalue("lite")["v2"]}[family]()
    model, _ = load_hf(path, overrides=INDEXER)
    ref = hf_logits(hf_model, tokens)
    dec = Decoder(model, "dense")
    P = 24
    caches = dec.init_cache(2, P + 12)
    logits, caches = dec.prefill(dec.state, jnp.asarray(tokens[:, :P]), jnp.full((2,), P, jnp.int32), caches)
    np.testing.assert_allclose(np.asarray(logits), ref[:, P - 1], atol=1e-4)
    for t in range(P, P + 12):
        logits, caches = dec.decode(dec.state, jnp.asarray(tokens[:, t]), jnp.full((2,), t, jnp.int32), caches)
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=1e-4, err_msg=f"position {t}")


def test_init_from_a_dense_hf_directory_equals_its_import(v3):
    """train.init_from the transformers directory itself: the fresh indexers take the stage model's shape (not
    DeepSeek-V3.2's default, which would not fit), and every tensor equals `glmjax-hf import`'s."""
    from glmjax.train.init_from import init_model

    _, path = v3[True]
    ref, _ = load_hf(path, overrides=INDEXER)
    model = GLM(ref.cfg, nnx.Rngs(1))
    lines = init_model(model, path)
    assert "fresh (not in the checkpoint): none" in lines and "dropped (not in this model): none" in lines, lines
    got, want = (traverse_util.flatten_dict(nnx.state(m).to_pure_dict()) for m in (model, ref))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))


def test_a_wrong_key_map_fails_the_parity_check(v3, tokens, monkeypatch):
    """Negative control: the dense MLP's gate_proj and up_proj swapped in the key map (same shapes, so the import
    itself succeeds) -> the logits are far from transformers'."""
    hf_model, path = v3[True]
    swapped = {"gate_proj": "up_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}
    monkeypatch.setattr(keymap, "_DENSE", [(f"mlp.{n}.weight", ("mlp", swapped[n]), "linear", 1) for n in swapped])
    model, _ = load_hf(path, overrides=INDEXER)
    err = float(np.max(np.abs(dense_logits(model, tokens) - hf_logits(hf_model, tokens))))
    assert err > 1e-2, err


def test_export_writes_deepseek_v32_that_transformers_loads_with_our_sparse_logits(v3, tokens, tmp_path):
    """The import (fresh indexers, as after any training of them) exported with its layout: a `deepseek_v32`
    checkpoint with the indexers, which DeepseekV32ForCausalLM loads (nothing missing or unexpected) and whose logits
    equal glmjax's *sparse* logits: the indexers select the same keys."""
    _, path = v3[True]
    model, layout = load_hf(path, overrides={**INDEXER, "scan_layers": False})
    out = str(tmp_path / "dsv32")
    save_hf(model, out, layout)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "deepseek_v32" and cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]) == (32, 32, 8)
    hf32, info = transformers.DeepseekV32ForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf32 = hf32.float().eval()
    ref, hf_used = hf_forward(hf32, tokens)
    logits, used, scores = ours_forward(model, tokens)
    for i, (u, h, sc) in enumerate(zip(used, hf_used, scores)):
        assert not topk_mismatches(u, h, sc), f"layer {i}: top-k sets differ"
    err = float(np.max(np.abs(logits - ref)))
    assert err < 1e-4, err
    assert float(np.max(np.abs(logits - dense_logits(model, tokens)))) > 1e-3  # sparse really differs from dense


def test_an_fp8_deepseek_v3_imports_dequantised_with_fresh_indexers(v3, tokens, tmp_path):
    """DeepSeek-V3's release format (float8 e4m3 linears, [128,128] block scales): the import dequantises, adds the
    fresh indexers and reproduces DeepseekV3ForCausalLM holding the hand-dequantised weights; export writes
    deepseek_v32 without a quantization_config."""
    from safetensors.torch import load_file
    from test_interop import fp8_checkpoint, save_ckpt

    hf_model, src = v3[True]
    path, deq_path = str(tmp_path / "fp8"), str(tmp_path / "dequantised")
    ref = fp8_checkpoint(src, path)
    model, layout = load_hf(path, overrides={**INDEXER, "scan_layers": False})
    assert sorted(layout.dequantized) == sorted(ref) and any(n.startswith("30 indexer tensors") for n in layout.notes)
    tensors = {**load_file(os.path.join(src, "model.safetensors")), **{k: torch.from_numpy(v) for k, v in ref.items()}}
    save_ckpt(deq_path, tensors, json.load(open(os.path.join(src, "config.json"))))
    deq = transformers.DeepseekV3ForCausalLM.from_pretrained(deq_path, attn_implementation="eager").float().eval()
    err = float(np.max(np.abs(dense_logits(model, tokens) - hf_logits(deq, tokens))))
    assert err < 1e-4, err
    assert float(np.max(np.abs(hf_logits(deq, tokens) - hf_logits(hf_model, tokens)))) > 1e-3  # FP8 really rounds
    out = str(tmp_path / "dsv32")
    save_hf(model, out, layout)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "deepseek_v32" and "quantization_config" not in cfg


@pytest.mark.slow
def test_walkthrough_import_recipe_export_loads_in_transformers(v3, tokens, tmp_path):
    """The README walkthrough "From a dense MLA checkpoint to DSA", its three commands: `glmjax-hf import` of a
    transformers-saved deepseek_v3 (fresh indexers) -> train.py's dense_warmup (only the indexers change) ->
    sparse_adapt (-> the optional indexshare) -> `glmjax-hf export` with the import's layout: a deepseek_v32
    checkpoint that DeepseekV32ForCausalLM loads (nothing missing or unexpected) to the trained model's sparse
    logits."""
    from glmjax.cli.hf import main as hf
    from glmjax.resolve import load_model
    from glmjax.workdir import load_model_state
    from test_reliability import ROOT, launch

    _, src = v3[True]
    ckpt, runs, out = (str(tmp_path / n) for n in ("ckpt", "runs", "dsv32"))
    sets = [a for kv in ("index_n_heads=32", "index_head_dim=32", "index_topk=8") for a in ("--set", kv)]
    assert hf(["import", src, ckpt, *sets, "--compilation-cache", ""]) == 0
    p = launch(runs, "--config.train.seq_len=32", "--config.train.batch_size=2", "--config.train.eval_batches=0",
               "--config.stages.dense_warmup.train.steps=6", "--config.stages.sparse_adapt.train.steps=6",
               "--config.stages.indexshare.train.steps=6", "--config.data.max_docs=50",
               "--config.recipe=('dense_warmup', 'sparse_adapt', 'indexshare')",
               flags=[f"--config={os.path.join(ROOT, 'configs', 'dsa_from_dense.py')}:{ckpt}"])
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-3000:]
    assert "trains indexer" in log and "init_from " + ckpt in log
    assert json.load(open(os.path.join(runs, "indexshare", "config.json")))["model"]["indexer_types"] == \
        ["full"] * 3 + ["shared"] * 3 and os.path.exists(os.path.join(runs, "indexshare", "summary.json"))
    def flat(tree):  # (orbax restores list indices as strings)
        return {tuple(map(str, k)): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}

    imported = flat(nnx.state(load_hf(src, overrides=INDEXER)[0]).to_pure_dict())
    warm = flat(load_model_state(os.path.join(runs, "dense_warmup"))[0])
    assert set(imported) == set(warm)
    changed = {k for k in imported if not np.array_equal(imported[k], warm[k])}
    assert changed and all("indexer" in k for k in changed), sorted(changed)[:5]
    assert hf(["export", os.path.join(runs, "sparse_adapt"), out, "--layout", ckpt, "--compilation-cache", ""]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "deepseek_v32"
    hf32, info = transformers.DeepseekV32ForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = load_model(os.path.join(runs, "sparse_adapt"))[0]
    h, _ = nnx.jit(lambda m, b: m(b, "sparse"))(model, batch_of(tokens))
    err = float(np.max(np.abs(np.asarray(model.logits(h)) - hf_logits(hf32.float().eval(), tokens))))
    assert err < 1e-4, err


# ------------------------------------------------------------------ deepseek_v2: DeepSeek-V2's softmax router


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    """{topk_method: (transformers DeepseekV2ForCausalLM, its directory)}: softmax routing, 4 groups / top-2 for the
    group-limited one, routed_scaling_factor 1.5, no router normalisation (DeepSeek-V2 has none)."""
    root = tmp_path_factory.mktemp("dense_mla_v2")
    out = {}
    for i, method in enumerate(("group_limited_greedy", "greedy")):
        out[method] = (build_hf("v2", str(root / method), 20 + i, topk_method=method, routed_scaling_factor=1.5),
                       str(root / method))
    return out


@pytest.mark.parametrize("method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_import_reproduces_transformers_in_dense_mode(v2, tokens, method):
    hf_model, path = v2[method]
    model, layout = load_hf(path, overrides=INDEXER)
    cfg = model.cfg
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.routed_scaling_factor) == \
        ("softmax", method, False, 1.5)
    assert any(n.startswith("5 router correction biases start at 0") for n in layout.notes)  # 5 MoE layers
    assert any("fresh" in n and n.startswith("30 indexer tensors") for n in layout.notes)
    err = float(np.max(np.abs(dense_logits(model, tokens) - hf_logits(hf_model, tokens))))
    assert err < 1e-4, err


def test_deepseek_v2_router_choices_matter(v2, tokens):
    """Negative controls: the group-limited checkpoint routed without the group limit, or with its weights normalised
    (GLM-5's norm_topk_prob), is far from transformers' logits (so the parity above tests the router)."""
    hf_model, path = v2["group_limited_greedy"]
    ref = hf_logits(hf_model, tokens)
    for wrong in ({"topk_method": "greedy"}, {"norm_topk_prob": True}):
        model, _ = load_hf(path, overrides={**INDEXER, **wrong})
        err = float(np.max(np.abs(dense_logits(model, tokens) - ref)))
        assert err > 1e-3, (wrong, err)


def assert_export_refused(src, tmp_path, capsys, reason: str):
    """`glmjax-hf import` of src, then `glmjax-hf export`: exit 2 with one line naming the reason, no tensor written."""
    from glmjax.cli.hf import main as hf

    ckpt = str(tmp_path / "ckpt")
    sets = [a for kv in ("index_n_heads=32", "index_head_dim=32", "index_topk=8") for a in ("--set", kv)]
    assert hf(["import", src, ckpt, *sets, "--compilation-cache", ""]) == 0
    capsys.readouterr()
    assert hf(["export", ckpt, str(tmp_path / "out"), "--compilation-cache", ""]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and reason in err[0], err
    assert not any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "out"))


def test_deepseek_v2_has_no_dsa_format_export_says_so_in_one_line(v2, tmp_path, capsys):
    from glmjax.config import ConfigError, ModelConfig

    assert_export_refused(v2["greedy"][1], tmp_path, capsys, "no DSA format in transformers has its router")
    with pytest.raises(ConfigError, match="topk_method='noaux_tc': must be one of"):
        ModelConfig.from_dict({"scoring_func": "softmax", "topk_method": "noaux_tc"})


# ------------------------------------ no query LoRA (q_lora_rank null): DeepSeek-V2-Lite, Moonlight-16B-A3B


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    """{family: (transformers model, its directory)} with q_lora_rank=None: deepseek_v2 (DeepSeek-V2-Lite's MLA and
    greedy softmax router) and deepseek_v3 (Moonlight's MLA and sigmoid router)."""
    root = tmp_path_factory.mktemp("dense_mla_lite")
    return {f: (build_hf(f, str(root / f), 30 + i, q_lora_rank=None), str(root / f))
            for i, f in enumerate(("v2", "v3"))}


@pytest.mark.parametrize("family", ["v2", "v3"])
def test_mla_without_a_query_lora_reproduces_transformers_in_dense_mode(lite, tokens, family):
    """The queries come from q_proj [D, H, d_qk]; the fresh indexers read the normed hidden state through wq."""
    hf_model, path = lite[family]
    model, layout = load_hf(path, overrides=INDEXER)
    assert model.cfg.q_lora_rank == 0 and any("no query LoRA" in n for n in layout.notes)
    assert any(n.startswith("30 indexer tensors") and "indexer.wq.weight" in n for n in layout.notes)
    names = {k[-1] for k in traverse_util.flatten_dict(nnx.state(model).to_pure_dict())}
    assert {"q_proj", "wq"} <= names and not names & {"q_a_proj", "q_b_proj", "wq_b"}
    err = float(np.max(np.abs(dense_logits(model, tokens) - hf_logits(hf_model, tokens))))
    assert err < 1e-4, err


def test_mla_without_a_query_lora_decodes_sparse_as_it_prefills(lite, tokens):
    """Sparse attention (the fresh indexers select 8 keys; IndexShare layers reuse them) on the latent and indexer
    caches: prefill + 16 decode steps give the logits of the sparse full forward at every position."""
    from test_decode import full_logits

    model, _ = load_hf(lite["v3"][1], overrides={**INDEXER, "indexer_types": ("full", "shared") * 3})
    P = 16
    want = [full_logits(model, list(row), "sparse") for row in tokens]
    dec = Decoder(model, "sparse")
    caches = dec.init_cache(2, P + 16)
    logits, caches = dec.prefill(dec.state, jnp.asarray(tokens[:, :P]), jnp.full((2,), P, jnp.int32), caches)
    np.testing.assert_allclose(np.asarray(logits), [w[P - 1] for w in want], atol=1e-4)
    for t in range(P, P + 16):
        logits, caches = dec.decode(dec.state, jnp.asarray(tokens[:, t]), jnp.full((2,), t, jnp.int32), caches)
        np.testing.assert_allclose(np.asarray(logits), [w[t] for w in want], atol=1e-4, err_msg=f"position {t}")
    assert np.abs(np.asarray(logits) - dense_logits(model, tokens)[:, P + 15]).max() > 1e-3  # sparse != dense here


def test_mla_without_a_query_lora_has_no_dsa_format_export_says_so_in_one_line(lite, tmp_path, capsys):
    """transformers' deepseek_v32 / glm_moe_dsa build their indexer on the q latent: export of such an import stops
    in one line (exit 2, no tensor written), and a DSA config.json with q_lora_rank null is refused."""
    from glmjax.config import ConfigError
    from glmjax.interop import config_from_hf

    _, path = lite["v3"]
    assert_export_refused(path, tmp_path, capsys, "without a query LoRA")
    dsa = {**json.load(open(os.path.join(path, "config.json"))), "model_type": "deepseek_v32"}
    with pytest.raises(ConfigError, match="q_lora_rank=None: deepseek_v32 needs a query LoRA"):
        config_from_hf(dsa)
