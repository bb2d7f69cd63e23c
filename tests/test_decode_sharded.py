"""Decoder on a mesh (8 CPU devices): prefill, extend, decode steps and greedy generate on context=4 x expert=2 and
on context=2 x fsdp=2 x tensor=2 equal the one-device Decoder (f32, <= 1e-5 relative; tokens identical), in dense
and sparse mode, for a batch of prompts of different lengths (13 and 21 tokens: 21 > index_topk 8, padded to 24
for the zig-zag layout) extended by a chunk of 3 (padded to 4 or 8); the caches are split over context (each
device holds T / context slots) and a decode step moves no cache rows between devices (its compiled collectives);
the same with the Pallas kernels (sparse, context=4 x expert=2).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from glmjax import parallel as par
from glmjax.infer import Decoder, forward_cached, generate
from glmjax.model import GLM, mla_paths
from helpers import FAST, tiny

MESHES = {"context4_expert2": dict(data=1, expert=2, context=4),
          "context2_fsdp2_tensor2": dict(data=1, fsdp=2, context=2, tensor=2)}
LENGTHS = np.array([13, 21], np.int32)
T = 76  # cache capacity: a multiple of 4 context shards; no dimension of the model is 76 or 80 (76 in key blocks)
EXTEND, STEPS, NEW = 3, 3, 6  # tokens appended by extend; decode steps checked one by one; generated


def small_cfg(**kw):
    """Layer 0 dense with its indexer, layer 1 MoE (16 experts) sharing its top-k; index_topk 8."""
    return tiny(num_hidden_layers=2, first_k_dense_replace=1, indexer_types=("full", "shared"),
                num_nextn_predict_layers=0, **kw)


def make_model():
    return GLM(small_cfg(), nnx.Rngs(3))


def make_seqs(vocab: int):
    return np.random.default_rng(0).integers(0, vocab, (2, T)).astype(np.int32)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def seqs(model):
    return make_seqs(model.cfg.vocab_size)


def run(dec: Decoder, seqs):
    """Prefill the prompts seqs[b, :LENGTHS[b]], extend each row by the next EXTEND tokens of seqs (a chunk of 3,
    padded inside), then decode STEPS tokens of seqs -> logits [2+STEPS, B, V], the caches; greedy generate of
    NEW tokens -> (tokens, log-probs)."""
    prompts = np.where(np.arange(LENGTHS.max())[None] < LENGTHS[:, None], seqs[:, :LENGTHS.max()], 0)
    caches = dec.init_cache(2, T)
    logits, caches = dec.prefill(dec.state, jnp.asarray(prompts), jnp.asarray(LENGTHS), caches)
    out = [np.asarray(logits)]
    chunk = np.stack([seqs[b, n:n + EXTEND] for b, n in enumerate(LENGTHS)])
    logits, caches = dec.extend(dec.state, jnp.asarray(chunk), jnp.asarray(LENGTHS), caches)
    out, cur = out + [np.asarray(logits)], LENGTHS + EXTEND
    for _ in range(STEPS):
        logits, caches = dec.decode(dec.state, jnp.asarray(seqs[np.arange(2), cur]), jnp.asarray(cur), caches)
        out.append(np.asarray(logits))
        cur += 1
    gen = generate(dec, [list(seqs[b, :n]) for b, n in enumerate(LENGTHS)], NEW, key=jax.random.key(0), max_len=T)
    return np.stack(out), caches, (gen.tokens, gen.logprobs)


def decode_run(mesh=None, mode: str = "sparse"):
    """run() of make_model()'s Decoder in `mode` on `mesh` (None: one device) -> (logits, tokens, logprobs), numpy
    (tests/test_multihost.py runs it on a mesh across two processes)."""
    model = make_model()
    logits, _, (tokens, logprobs) = run(Decoder(model, mode, mesh=mesh, compiler_options=FAST),
                                        make_seqs(model.cfg.vocab_size))
    return logits, np.asarray(tokens), np.asarray(logprobs)


@pytest.fixture(scope="module")
def reference(model, seqs):
    """One device, per mode: run()'s logits and generated tokens."""
    out = {}
    for mode in ("dense", "sparse"):
        logits, _, gen = run(Decoder(model, mode, compiler_options=FAST), seqs)
        out[mode] = logits, gen
    return out


def assert_close(got, want):
    """Per row of logits: ||got - want|| <= 1e-5 ||want||."""
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() <= 1e-5, err


def collective_shapes(hlo: str):
    """Result shapes [dims] of every collective in compiled HLO text."""
    ops = r"(?:all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?"
    for m in re.finditer(rf"= \(?([^=]*?)\)? {ops}\(", hlo):
        for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1)):
            yield [int(d) for d in dims.split(",") if d]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_decoder_on_mesh_equals_one_device(name, mode, model, seqs, reference, monkeypatch):
    """Dense mode with attention over a cache always blocked where it may be (one device: materialised): prefill's
    local queries by flash attention over the gathered cache rows; decode materialised over the context-split cache
    (glmjax/model/mla_variants.py absorbed_attention)."""
    if mode == "dense":
        monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(materialise_scores=0))
    mesh = par.make_mesh(MESHES[name])
    n = mesh.shape["context"]
    dec = Decoder(model, mode, mesh=mesh, compiler_options=FAST)
    logits, caches, (tokens, logprobs) = run(dec, seqs)
    want_logits, (want_tokens, want_logprobs) = reference[mode]
    assert_close(logits, want_logits)  # prefill, extend, then every decode step
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-6)
    for leaf in jax.tree.leaves(caches):  # [n_units, B, T, C]: T split over context, B over the batch axes
        assert leaf.sharding.spec[2] == "context", leaf.sharding
        assert {s.data.shape[2] for s in leaf.addressable_shards} == {T // n}
    assert_keeps_cache(dec, caches)
    if mode == "sparse":  # negative control: sparse attention drops keys here (dense decode logits differ)
        assert np.abs(want_logits[1:] - reference["dense"][0][1:]).max() > 1e-3


def assert_keeps_cache(dec: Decoder, caches):
    """A decode step keeps the cache where it is: no collective carries T slots (or T padded to whole key blocks)
    of more than a few values per slot (the [B,T] index scores of the top-k may cross; the [B,T,48] latent or
    [B,T,32] indexer-key cache may not)."""
    hlo = dec.decode.lower(dec.state, jnp.zeros(2, jnp.int32), jnp.asarray(LENGTHS), caches).compile().as_text()
    slots = {T, -(-T // dec.model.cfg.block_q) * dec.model.cfg.block_q}
    moved = [s for s in collective_shapes(hlo) if any(d in slots and np.prod(s) // d >= 16 for d in s)]
    assert not moved, moved


@pytest.mark.slow
def test_pallas_decoder_on_mesh_equals_one_device(seqs, reference, monkeypatch):
    """attention_impl="pallas" on context=4 x expert=2 (the kernels interpreted, "fast"): a decode step runs the
    indexer top-k on each shard's slots and merges the candidates, and the sparse attention on each shard's
    selected rows, combined by log-sum-exp (glmjax/model/backends.py); it equals one device (the XLA decoder, whose
    top-k and attention the kernels reproduce) and moves no cache rows."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    dec = Decoder(GLM(small_cfg(attention_impl="pallas"), nnx.Rngs(3)), "sparse",
                  mesh=par.make_mesh(MESHES["context4_expert2"]), compiler_options=FAST)
    logits, caches, (tokens, logprobs) = run(dec, seqs)
    want_logits, (want_tokens, want_logprobs) = reference["sparse"]
    assert_close(logits, want_logits)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-6)
    assert_keeps_cache(dec, caches)


def test_decoder_on_mesh_rejects_bad_input(model):
    mesh = par.make_mesh(MESHES["context4_expert2"])
    dec = Decoder(model, "sparse", mesh=mesh)
    assert dec.cache_multiple == 4
    with pytest.raises(ValueError, match=r"max_len=30: .* 4 context shards .* multiple of 4"):
        dec.init_cache(2, 30)
    caches = jax.eval_shape(lambda: dec.init_cache(1, 40))  # a step of 12 tokens is not split into 8 chunks
    with pytest.raises(ValueError, match=r"sequence length 12: model.context_layout='zigzag' on 4 .* multiple of 8"):
        jax.eval_shape(par.with_mesh(lambda s, t, c: forward_cached(nnx.merge(dec.graphdef, s), t, jnp.zeros(
            1, jnp.int32), c, "sparse"), mesh), dec.state, jnp.zeros((1, 12), jnp.int32), caches)
