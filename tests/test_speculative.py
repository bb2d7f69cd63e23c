"""Greedy speculative decoding with the MTP layer as the draft (glmjax/infer/speculative.py) against plain greedy
decoding: the same tokens for prompts of different lengths whose rows accept different numbers of drafts, stop tokens,
dense and sparse attention, IndexShare layers (tiny(): F F S S F S); one compilation for every acceptance pattern;
rejected drafts' cache rows never survive (the caches equal a prefill of the emitted sequence, and fail to once the
rollback is removed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax.infer.speculative as speculative
from glmjax.infer import Decoder, SpeculativeDecoder, generate
from glmjax.infer.generate import speculator
from glmjax.model import GLM
from helpers import tiny

PROMPT_LENS = (5, 12, 20, 9, 1)


def drafting_model(mode: str, layer_scale: float = 1.8, seed: int = 0) -> tuple[Decoder, np.ndarray]:
    """A tiny model whose greedy continuation mostly follows a fixed permutation of the vocabulary and whose MTP
    layer drafts that permutation's next token, so drafts are often but not always accepted: lm_head reads the
    permuted embeddings, eh_proj passes only the embedding through, and the layers' output projections are scaled
    by layer_scale so the context (the caches) changes some tokens. -> (Decoder, the permutation)."""
    cfg = tiny()
    model = GLM(cfg, nnx.Rngs(seed))
    D = cfg.hidden_size
    perm = np.random.default_rng(seed).permutation(cfg.vocab_size)
    emb = np.asarray(model.embed_tokens[...])
    model.lm_head[...] = jnp.asarray(emb[np.argsort(perm)].T)  # logits[v] = h . Embed[perm^-1(v)]
    model.mtp.eh_proj[...] = jnp.asarray(np.eye(2 * D, D, dtype=np.float32))  # [enorm(emb); hnorm(h)] -> enorm(emb)

    def scale(path, v):
        out = any(n in jax.tree_util.keystr(path) for n in ("o_proj", "down_proj", "experts_down"))
        return v * layer_scale if out else v

    nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model)))
    return Decoder(model, mode), perm


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_greedy_speculative_equals_plain_greedy_token_for_token(mode):
    dec, perm = drafting_model(mode)
    ps = prompts()
    plain = generate(dec, ps, 32, key=jax.random.key(0))
    follows = np.mean(plain.tokens[:, 1:] == perm[plain.tokens[:, :-1]])
    assert 0.3 < follows < 0.95, follows  # drafts right often, not always: the context matters
    stop = int(plain.tokens[1, 9])  # row 1 stops at its 10th token (and every row at that token's first use)
    plain_stop = generate(dec, ps, 32, key=jax.random.key(0), stop_tokens=[stop])
    assert plain_stop.lengths[1] <= 10 and plain_stop.lengths.max() > 10
    for d in ((1, 3) if mode == "sparse" else (3,)):
        for want, stops in ((plain, []), (plain_stop, [stop])):
            got = generate(dec, ps, 32, key=jax.random.key(1), speculative=d, stop_tokens=stops)
            np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"d={d} stops={stops}")
            np.testing.assert_array_equal(got.lengths, want.lengths)
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
            if not stops:  # tokens per verify pass, per row: rows accept different numbers of drafts
                per_verify = (got.lengths - 1) / got.steps
                assert per_verify.min() >= 1 and per_verify.max() > 1.3 and len(set(got.steps)) > 1, per_verify
    # the round that prefill starts and the rounds after it are one program (the shapes never change)
    assert speculator(dec, 3).round._cache_size() == 1 and speculator(dec, 3).prefill._cache_size() == 1


def run_rounds(spec: SpeculativeDecoder, ps, n_rounds: int, capacity: int = 64):
    """prefill + n_rounds rounds -> (each row's tokens: prompt + emitted, the last Round, caches, mtp_cache)."""
    B, P = len(ps), max(map(len, ps))
    tokens = np.zeros((B, P), np.int32)
    for b, p in enumerate(ps):
        tokens[b, :len(p)] = p
    caches, mtp_cache = spec.init_cache(B, capacity)
    x0, _, r, caches, mtp_cache = spec.prefill(spec.decoder.state, jnp.asarray(tokens),
                                               jnp.asarray([len(p) for p in ps], jnp.int32), caches, mtp_cache)
    seqs = [list(p) + [int(x)] for p, x in zip(ps, np.asarray(x0))]
    accs = []
    for _ in range(n_rounds):
        emitted, _, acc, r, caches, mtp_cache = spec.round(spec.decoder.state, r, caches, mtp_cache)
        acc = np.asarray(acc)
        accs.append(acc)
        for b in range(B):
            seqs[b] += np.asarray(emitted)[b, :acc[b] + 1].tolist()
    return seqs, r, caches, mtp_cache, np.stack(accs)


@pytest.mark.parametrize("rollback", [True, False])
def test_rejected_drafts_leave_no_cache_row_behind(rollback, monkeypatch):
    """After 6 rounds (d = 3, rows accepting different numbers of drafts, some rejections) every cache row the next
    round may read -- the main model's latent and indexer-key rows of each row's verified tokens, the MTP layer's rows
    of the positions it has redone -- equals a fresh prefill of the emitted sequence. With the rollback removed (each
    verify's successor starting past all d drafts, accepted or not; the first round still starts right after the
    prompt) the main cache holds rejected drafts among the verified rows and the same check fails there."""
    d = 3
    if not rollback:
        monkeypatch.setattr(speculative, "next_start", lambda start, acc: start + d + 1)
    dec, _ = drafting_model("sparse")
    spec = SpeculativeDecoder(dec, d)
    seqs, r, caches, mtp_cache, accs = run_rounds(spec, prompts(), 6)
    assert (accs < d).any() and (accs > 0).any()  # rejections and acceptances
    n_main = np.asarray(r.start)  # slots holding verified tokens
    n_mtp = np.asarray(r.c0)  # slots whose MTP rows the last round's first pass redid from verified inputs
    fresh = [seq[:n] for seq, n in zip(seqs, n_main)]  # (the last emitted token is not in the cache yet)
    ref_caches, ref_mtp = spec.init_cache(len(fresh), 64)
    tokens = np.zeros((len(fresh), max(map(len, fresh))), np.int32)
    for b, seq in enumerate(fresh):
        tokens[b, :len(seq)] = seq
    _, _, _, ref_caches, ref_mtp = spec.prefill(dec.state, jnp.asarray(tokens), jnp.asarray(n_main, jnp.int32),
                                                ref_caches, ref_mtp)
    pairs = [("main", a, b, n_main) for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(ref_caches))]
    pairs += [(f"mtp {k}", mtp_cache[k][None], ref_mtp[k][None], n_mtp) for k in ("latent", "index_k")]
    bad = []
    for name, got, want, n in pairs:  # [units, B, T, C]
        for b in range(len(fresh)):
            if not np.allclose(np.asarray(got)[:, b, :n[b]], np.asarray(want)[:, b, :n[b]], atol=1e-5):
                bad.append((name, b))
    if rollback:
        assert not bad, bad
        np.testing.assert_array_equal([len(s) for s in seqs], n_main + 1)
    else:
        assert any(name == "main" for name, _ in bad)  # rejected drafts' rows sit among the verified ones


def test_speculative_decoding_refuses_what_it_cannot_do():
    model = GLM(tiny(num_nextn_predict_layers=0), nnx.Rngs(0))
    with pytest.raises(ValueError, match="drafts with the MTP layer, and this model has none"):
        generate(Decoder(model, "sparse"), [[1, 2]], 4, key=jax.random.key(0), speculative=2)
    dec, _ = drafting_model("sparse")
    with pytest.raises(ValueError, match="decodes greedily: temperature must be 0"):
        generate(dec, [[1, 2]], 4, key=jax.random.key(0), speculative=2, temperature=0.7)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            SpeculativeDecoder(dec, bad)
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            speculator(dec, bad)
    with pytest.raises(ValueError, match=r"max_len=8 < longest prompt 2 \+ max_new_tokens 4 \+ speculative 3"):
        generate(dec, [[1, 2]], 4, key=jax.random.key(0), speculative=3, max_len=8)
