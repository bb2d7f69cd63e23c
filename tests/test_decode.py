"""Prefill + decode with the MLA latent cache against the full (training) forward pass; sampling; generate."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.infer import Decoder, generate, sample
from glmjax.model import GLM, Batch
from helpers import THREE_LAYERS, tiny


@pytest.fixture(scope="module")
def model():
    return GLM(tiny(**THREE_LAYERS), nnx.Rngs(11))  # F F S, index_topk 8


def full_logits(model, seq, mode, pad_to=None):
    """Training forward of one sequence -> logits [len(seq), V]. Padding the tail (pad_to) cannot change them
    (causality, tested in test_model) and keeps one compilation for sequences of different lengths."""
    S = pad_to or len(seq)
    tok = np.zeros((1, S), np.int32)
    tok[0, :len(seq)] = seq
    b = Batch(jnp.asarray(tok), jnp.ones((1, S), jnp.int32), jnp.arange(S, dtype=jnp.int32)[None])
    h, _ = _forward(model, b, mode)
    return np.asarray(model.logits(h))[0, :len(seq)]


_forward = nnx.jit(lambda m, b, mode: m(b, mode), static_argnums=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_decode_steps_reproduce_the_full_forward(model, mode):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, 40).tolist() for _ in range(2)]
    prompt_lens = np.array([12, 20], np.int32)  # different lengths in one batch
    want = [full_logits(model, s, mode) for s in seqs]

    dec = Decoder(model, mode)
    caches = dec.init_cache(2, 40)
    prompts = np.zeros((2, 20), np.int32)
    for b in range(2):
        prompts[b, :prompt_lens[b]] = seqs[b][:prompt_lens[b]]
    logits, caches = dec.prefill(dec.state, jnp.asarray(prompts), jnp.asarray(prompt_lens), caches)
    for b in range(2):
        np.testing.assert_allclose(logits[b], want[b][prompt_lens[b] - 1], atol=1e-4)
    cur = prompt_lens.copy()
    for _ in range(20):  # row 0 decodes positions 12..31, row 1 positions 20..39 (all > index_topk)
        tok = jnp.asarray([seqs[b][cur[b]] for b in range(2)], jnp.int32)
        logits, caches = dec.decode(dec.state, tok, jnp.asarray(cur), caches)
        for b in range(2):
            np.testing.assert_allclose(logits[b], want[b][cur[b]], atol=1e-4)
        cur += 1
    assert dec.decode._cache_size() == 1  # one compilation for all decode steps
    if mode == "sparse":  # negative control: sparse decode really differs from dense attention here
        dense_want = full_logits(model, seqs[1], "dense")
        assert np.abs(np.asarray(logits[1]) - dense_want[39]).max() > 1e-3


def test_cache_layout_keeps_no_indexer_cache_on_shared_layers(model):
    caches = Decoder(model, "sparse").init_cache(3, 16)
    # units: [F] [F S]
    assert [sorted(c) for c in caches[1]] == [["index_k", "latent"], ["latent"]]
    cfg = model.cfg
    assert caches[0][0]["latent"].shape == (1, 3, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert caches[0][0]["index_k"].shape == (1, 3, 16, cfg.index_head_dim)


@pytest.mark.slow
def test_greedy_generate_matches_a_naive_full_forward_loop(model):
    prompts = [[5, 17, 300, 42, 9, 9, 100, 7, 8, 1, 2, 3], [77, 78]]
    n_new = 14  # row 0 reaches 26 tokens > index_topk
    naive_tok, naive_lp = [], []
    for p in prompts:
        seq, toks, lps = list(p), [], []
        for _ in range(n_new):
            lg = full_logits(model, seq, "sparse", pad_to=32)[-1]
            t = int(np.argmax(lg))
            toks.append(t)
            lps.append(float(jax.nn.log_softmax(lg)[t]))
            seq.append(t)
        naive_tok.append(toks)
        naive_lp.append(lps)
    dec = Decoder(model, "sparse")
    out = generate(dec, prompts, n_new, key=jax.random.key(0))
    np.testing.assert_array_equal(out.tokens, naive_tok)
    np.testing.assert_allclose(out.logprobs, naive_lp, atol=1e-4)
    assert list(out.lengths) == [n_new, n_new]
    # a stop token ends row 0 at its first occurrence; row 1 continues
    stop = naive_tok[0][3]
    first = naive_tok[0].index(stop)
    out = generate(dec, prompts, n_new, key=jax.random.key(0), stop_tokens=[stop], pad_id=0)
    assert out.lengths[0] == first + 1 and (out.tokens[0, first + 1:] == 0).all()
    assert (out.logprobs[0, first + 1:] == 0).all()
    row1_stop = stop in naive_tok[1]
    assert out.lengths[1] == (naive_tok[1].index(stop) + 1 if row1_stop else n_new)


def test_sampling_distribution_temperature_and_top_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    toks, lps = jax.vmap(lambda k: sample(logits, k, temperature=1.0, top_p=1.0))(keys)
    freq = np.bincount(np.asarray(toks[:, 0]), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    np.testing.assert_allclose(np.exp(lps[:, 0]), np.asarray([0.5, 0.3, 0.15, 0.05])[np.asarray(toks[:, 0])],
                               rtol=1e-5)
    # top-p 0.7 keeps {0, 1} (0.5 + 0.3 >= 0.7): tokens 2 and 3 never drawn
    toks, _ = jax.vmap(lambda k: sample(logits, k, temperature=1.0, top_p=0.7))(keys)
    assert set(np.unique(toks)) == {0, 1}
    # temperature 0.5 sharpens: p ~ p^2
    toks, lps = jax.vmap(lambda k: sample(logits, k, temperature=0.5, top_p=1.0))(keys)
    p2 = np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365
    np.testing.assert_allclose(np.bincount(np.asarray(toks[:, 0]), minlength=4) / 4000, p2, atol=0.03)
    # same key, same draw; greedy ignores the key
    a = sample(logits, jax.random.key(3), temperature=1.0, top_p=1.0)
    b = sample(logits, jax.random.key(3), temperature=1.0, top_p=1.0)
    assert int(a[0][0]) == int(b[0][0])
    assert int(sample(logits, jax.random.key(9), temperature=0.0, top_p=1.0)[0][0]) == 0


def test_generate_rejects_bad_input(model):
    dec = Decoder(model, "sparse")
    with pytest.raises(ValueError, match="at least one token"):
        generate(dec, [[1], []], 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="outside"):
        generate(dec, [[1, 9999]], 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_len"):
        generate(dec, [[1, 2, 3]], 5, key=jax.random.key(0), max_len=6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_chunked_prefill_equals_the_full_forward(model, mode):
    seq = np.random.default_rng(5).integers(0, 512, 30).tolist()
    want = full_logits(model, seq, mode)
    dec = Decoder(model, mode)
    caches = dec.init_cache(1, 32)
    for start, stop in [(0, 16), (16, 30)]:
        tok = jnp.asarray([seq[start:stop]], jnp.int32)
        logits, caches = dec.extend(dec.state, tok, jnp.asarray([start], jnp.int32), caches)
        np.testing.assert_allclose(logits[0], want[stop - 1], atol=1e-4)
