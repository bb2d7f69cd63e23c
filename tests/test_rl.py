"""PPO stage (glmjax/rl): advantages vs naive loops, policy/value losses on hand-computed cases, exact token-mean
aggregation across micro-batches and devices, sample hygiene, the rollout loop with tools and the reward-hacking
interceptor, trainer/sampler log-prob agreement, config validation."""
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from glmjax.config import ConfigError
from glmjax.infer import Decoder
from glmjax.model import GLM
from glmjax.rl import default_ppo_config, validate_ppo_config
from glmjax.rl.advantages import explained_variance, gae, grpo, masked_whiten
from glmjax.rl.env import EOS, SingleTurnEnv, ToolEnv, decode, encode, run_script, use_calculator, read_answer_file
from glmjax.rl.interceptor import Interceptor, ToolCall
from glmjax.rl.losses import PolicyLossConfig, kl_k3, loss_weights, policy_loss, value_loss
from glmjax.rl.ppo import _gae_both, pack_samples
from glmjax.rl.rollout import RolloutBatch, RolloutWorker, Sample, Sampler, filter_groups
from glmjax.rl.tasks import Arithmetic, Problem, Reverse, Sort, exact_reward, partial_reward, safe_eval
from glmjax.rl.trainer import (ACTOR_TRAINABLE, CRITIC_TRAINABLE, Placement, PPOFunctions, accumulate,
                               critic_values, init_value_head, token_logprobs)
from helpers import tiny

SMALL = dict(num_hidden_layers=2, indexer_types=("full", "shared"), n_routed_experts=8, n_group=4, topk_group=2,
             num_experts_per_tok=2, num_nextn_predict_layers=0, index_topk=8)


# ------------------------------------------------------------------------------------------------ advantages

def naive_gae(r, v, m, gamma, lam, boot=None):
    """Per row: walk the mask tokens backwards; masked tokens do not exist for the recursion. After the last one,
    V = boot[b] (0 without)."""
    adv = np.zeros_like(r)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b])
        next_v, next_a = (0.0 if boot is None else boot[b]), 0.0
        for t in idx[::-1]:
            delta = r[b, t] + gamma * next_v - v[b, t]
            next_a = delta + gamma * lam * next_a
            next_v = v[b, t]
            adv[b, t] = next_a
    return adv, (adv + v) * m


def random_episode_arrays(seed, B=5, T=23):
    rng = np.random.default_rng(seed)
    m = (rng.random((B, T)) < 0.6).astype(np.float32)
    m[:, :3] = 0  # prompt
    m[0] = 0  # a row without policy tokens
    m[1, 3:] = 1  # a row without holes
    r = np.zeros((B, T), np.float32)
    for b in range(B):  # the task reward on the last policy token, plus a few intermediate rewards
        idx = np.flatnonzero(m[b])
        if len(idx):
            r[b, idx[-1]] = rng.normal()
            r[b, idx[: len(idx) // 2]] += 0.1 * rng.normal(size=len(idx) // 2)
    v = rng.normal(size=(B, T)).astype(np.float32)
    return r, v, m


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_a_naive_loop(gamma, lam):
    r, v, m = random_episode_arrays(0)
    adv, ret = gae(r, v, m, gamma, lam)
    want_adv, want_ret = naive_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[m == 0] == 0)


def test_gae_ignores_values_at_masked_positions():
    r, v, m = random_episode_arrays(1)
    adv, ret = gae(r, v, m, 0.97, 0.9)
    v2 = np.where(m > 0, v, 100 * np.random.default_rng(2).normal(size=v.shape)).astype(np.float32)
    adv2, ret2 = gae(r, v2, m, 0.97, 0.9)
    np.testing.assert_array_equal(adv, adv2)
    np.testing.assert_array_equal(ret, ret2)
    # negative control: a value at a policy token does change the advantages
    b, t = 2, int(np.flatnonzero(m[2])[1])
    v3 = v.copy()
    v3[b, t] += 1.0
    assert not np.allclose(gae(r, v3, m, 0.97, 0.9)[0], adv)


def test_gae_closed_form_skips_tool_tokens():
    """Reward 1 at the end, gamma = lam = 1: every advantage is R - V_t regardless of tool tokens in between; with
    lam = 0 it is the one-step TD error to the next *policy* token, across the tool span."""
    m = np.array([[0, 1, 1, 0, 0, 1, 1]], np.float32)
    v = np.array([[9, .1, .2, 9, 9, .5, .7]], np.float32)
    r = np.array([[0, 0, 0, 0, 0, 0, 1]], np.float32)
    adv, ret = gae(r, v, m, 1.0, 1.0)
    np.testing.assert_allclose(adv[0], [0, .9, .8, 0, 0, .5, .3], atol=1e-6)
    np.testing.assert_allclose(ret[0], m[0], atol=1e-6)  # returns before whitening = R on every policy token
    adv0, _ = gae(r, v, m, 1.0, 0.0)
    np.testing.assert_allclose(adv0[0], [0, .1, .3, 0, 0, .2, .3], atol=1e-6)


def test_grpo_and_whitening():
    scores = np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    m = np.ones((8, 3), np.float32)
    m[0, 2] = 0
    adv = np.asarray(grpo(scores, groups, m))
    np.testing.assert_allclose(adv[:4, 0], [1, -1, -1, 1], atol=1e-5)  # (r - 0.5) / 0.5
    assert np.all(adv[4:] == 0) and adv[0, 2] == 0
    np.testing.assert_allclose(np.asarray(grpo(scores, groups, m, use_std=False))[:4, 0], [.5, -.5, -.5, .5])
    x = np.random.default_rng(0).normal(3, 2, (4, 6)).astype(np.float32)
    mk = (np.random.default_rng(1).random((4, 6)) < 0.7).astype(np.float32)
    w = np.asarray(masked_whiten(x, mk))
    sel = w[mk > 0]
    np.testing.assert_allclose([sel.mean(), sel.std()], [0, 1], atol=1e-4)
    assert np.all(w[mk == 0] == 0)


def test_explained_variance():
    g = np.array([[0, 1, 2, 3]], np.float32)
    m = np.array([[0, 1, 1, 1]], np.float32)
    assert float(explained_variance(g, g, m)) == pytest.approx(1.0)
    assert float(explained_variance(np.full_like(g, 2.0), g, m)) == pytest.approx(0.0, abs=1e-6)
    assert float(explained_variance(-g, g, m)) < 0
    assert np.isnan(float(explained_variance(g, np.ones_like(g), m)))


# ------------------------------------------------------------------------------------------------ losses

def ratios_case():
    ratio = np.array([2.0, 2.0, 0.5], np.float32)
    return jnp.log(jnp.asarray(ratio)), np.zeros(3, np.float32), np.array([2.0, -2.0, 2.0], np.float32)


def test_ppo_clip_hand_computed():
    logp, old, adv = ratios_case()
    loss, clipped = policy_loss(logp, old, old, adv, PolicyLossConfig("ppo_clip", 0.2, 0.2, dual_clip=1.5))
    np.testing.assert_allclose(loss, [-2.4, 3.0, -1.0], rtol=1e-6)
    np.testing.assert_array_equal(clipped, [1, 0, 0])
    loss, _ = policy_loss(logp, old, old, adv, PolicyLossConfig("ppo_clip", 0.2, 0.2))
    np.testing.assert_allclose(loss, [-2.4, 4.0, -1.0], rtol=1e-6)  # without the dual clip


def grad_per_token(cfg, logp, old, rollout, adv):
    return np.asarray(jax.grad(lambda lp: jnp.sum(policy_loss(lp, old, rollout, adv, cfg)[0]))(jnp.asarray(logp)))


def test_two_sided_masking_differs_from_clipping():
    """Token 0: ratio 0.5 < 1 - eps with A > 0 -- clipping keeps the pessimistic (unclipped) branch and its gradient
    (dL/dlogp = -ratio*A = -1); two-sided masking drops the token: no loss, no gradient. Token 1: ratio 2 with A < 0,
    the same picture above the band. Token 2: inside the band, identical."""
    logp = np.log([0.5, 2.0, 1.1]).astype(np.float32)
    zero = np.zeros(3, np.float32)
    adv = np.array([2.0, -1.0, 1.0], np.float32)
    clip = PolicyLossConfig("ppo_clip", 0.2, 0.2)
    two = PolicyLossConfig("async_two_sided", 0.2, 0.2)
    g_clip = grad_per_token(clip, logp, zero, zero, adv)
    g_two = grad_per_token(two, logp, zero, zero, adv)  # the ratio is against the rollout log-probs
    np.testing.assert_allclose(g_clip, [-1.0, 2.0, -1.1], rtol=1e-6)
    np.testing.assert_allclose(g_two, [0.0, 0.0, -1.1], rtol=1e-6)
    loss, masked = policy_loss(jnp.asarray(logp), zero, zero, adv, two)
    np.testing.assert_allclose(loss, [0.0, 0.0, -1.1], rtol=1e-6)
    np.testing.assert_array_equal(masked, [1, 1, 0])
    # two-sided reads the *rollout* log-probs, not the recomputed old ones
    g = grad_per_token(two, logp, np.log([0.5, 2.0, 1.1]).astype(np.float32), zero, adv)
    np.testing.assert_allclose(g, g_two)


def test_icepop_drops_tokens_where_trainer_and_sampler_disagree():
    logp = np.zeros(3, np.float32)  # current = old: ratio 1
    old = np.zeros(3, np.float32)
    rollout = np.log([1.0, 1 / 3.0, 1.5]).astype(np.float32)  # k = pi_old / pi_rollout = 1, 3, 1/1.5
    adv = np.ones(3, np.float32)
    loss, dropped = policy_loss(jnp.asarray(logp), old, rollout, adv, PolicyLossConfig("icepop", icepop_low=0.5,
                                                                                        icepop_high=2.0))
    np.testing.assert_allclose(loss, [-1.0, 0.0, -1 / 1.5], rtol=1e-6)
    np.testing.assert_array_equal(dropped, [0, 1, 0])


def test_value_loss_clipped():
    v = jnp.array([1.0, 0.0, 0.5])
    old = jnp.array([0.5, 0.5, 0.5])
    ret = jnp.array([0.0, 1.0, 0.5])
    # token 0: unclipped 0.5*1^2, clipped v' = 0.7 -> 0.5*0.49; max = 0.5. token 1: unclipped 0.5, clipped v' = 0.3
    # -> 0.5*0.49; max 0.5. Clipping matters when the clipped prediction is *farther*: v=0.9, old 0.5, G=1.0
    np.testing.assert_allclose(value_loss(v, old, ret, 0.2), [0.5, 0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(value_loss(jnp.array([0.9]), jnp.array([0.5]), jnp.array([1.0]), 0.2),
                               [0.5 * 0.3 ** 2], rtol=1e-5)
    np.testing.assert_allclose(value_loss(jnp.array([0.9]), jnp.array([0.5]), jnp.array([1.0]), 0.0),
                               [0.5 * 0.1 ** 2], rtol=1e-5)


def test_kl_k3():
    logp = jnp.log(jnp.array([0.5, 0.2, 0.3]))
    np.testing.assert_allclose(kl_k3(logp, logp), 0, atol=1e-7)
    ref = jnp.log(jnp.array([0.25, 0.4, 0.35]))
    k = np.asarray(kl_k3(logp, ref))
    assert np.all(k > 0)
    # E_{x ~ pi}[k3] = KL(pi || ref) exactly for categorical pi
    p = np.exp(np.asarray(logp))
    np.testing.assert_allclose((p * k).sum(), (p * (np.asarray(logp) - np.asarray(ref))).sum(), rtol=1e-5)
    g = jax.grad(lambda lp: jnp.sum(kl_k3(lp, ref)))(logp)  # d/dlogp = 1 - exp(ref - logp)
    np.testing.assert_allclose(g, 1 - np.exp(np.asarray(ref) - np.asarray(logp)), rtol=1e-5)


def test_loss_weights():
    m = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(loss_weights(m, "token_mean"), m / 5)
    w = loss_weights(m, "seq_mean_token_mean")
    np.testing.assert_allclose(w[0], [1 / 8] * 4)
    np.testing.assert_allclose(w[1], [1 / 2, 0, 0, 0])
    assert w.sum() == pytest.approx(1.0)


# ------------------------------------------------------------------------ exact aggregation across splits / devices

@pytest.fixture(scope="module")
def small_model():
    return GLM(tiny(**{**SMALL, "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 32, "index_topk": 4}),
               nnx.Rngs(3))


@pytest.mark.slow
def test_loss_and_grads_identical_for_any_micro_batch_and_device_split():
    """Actor and critic (loss sums, gradients) accumulated over micro-batches x data-parallel devices equal the
    single-shot values, for the global token mean and the per-sequence mean; the loss equals an independent plain
    full-batch aggregate; averaging per-micro-batch means (the peer bug) would not. A one-layer dense model keeps
    the compilations cheap: only the aggregation is under test."""
    model = GLM(tiny(**{**SMALL, "num_hidden_layers": 1, "indexer_types": ("full",), "hidden_size": 32,
                        "intermediate_size": 64, "q_lora_rank": 16, "index_topk": 4}), nnx.Rngs(3))
    graphdef, params, rest = nnx.split(model, ACTOR_TRAINABLE, ...)
    cgraphdef, cparams, crest = nnx.split(model, CRITIC_TRAINABLE, ...)
    head = {"w": jnp.full((model.cfg.hidden_size,), 0.05), "b": jnp.float32(0.0)}
    fns = PPOFunctions(graphdef, cgraphdef, "sparse", 1.0, 5, PolicyLossConfig("ppo_clip", 0.2, 0.28, 3.0),
                       entropy_coef=0.01, kl_coef=0.05, value_clip=0.2)  # every loss term on
    B, S = 8, 12
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, S + 1, B)  # different lengths: token mean != mean of micro-batch means
    seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    mb = {"tokens": rng.integers(0, 256, (B, S)).astype(np.int32), "segment_ids": seg,
          "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))}
    logp = np.asarray(fns.logprobs(params, rest, mb))
    mb.update(old_logp=logp + rng.normal(0, 0.2, (B, S)).astype(np.float32), rollout_logp=logp,  # some clipped
              ref_logp=logp + rng.normal(0, 0.3, (B, S)).astype(np.float32),
              advantages=rng.normal(size=(B, S)).astype(np.float32), returns=rng.random((B, S)).astype(np.float32),
              old_values=rng.normal(0, .1, (B, S)).astype(np.float32))
    mask = ((np.arange(S)[None] >= 3) & (seg > 0)).astype(np.float32)
    per_tok = np.asarray(policy_loss(jnp.asarray(logp), mb["old_logp"], logp, mb["advantages"], fns.ploss)[0])
    assert 0 < np.asarray(policy_loss(jnp.asarray(logp), mb["old_logp"], logp, mb["advantages"],
                                      fns.ploss)[1])[mask > 0].mean() < 1  # both branches occur

    for agg in ("token_mean", "seq_mean_token_mean"):
        mb["weights"] = loss_weights(mask, agg)
        results = {}
        for n_micro, n_dev in [(1, 1), (4, 1), (2, 2), (1, 4)]:
            place = Placement(n_dev)
            actor = accumulate(fns.actor_grads, place.replicate((params, rest)), mb, n_micro, place)
            critic = accumulate(fns.critic_grads, place.replicate((cparams, crest, head)), mb, n_micro, place)
            results[(n_micro, n_dev)] = jax.device_get((actor, critic))
        ref = results[(1, 1)]
        for key, got in results.items():
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=f"{agg} {key}")
        if agg == "token_mean":
            want = (per_tok * mask).sum() / mask.sum()
            halves = [slice(0, 4), slice(4, 8)]
            naive = np.mean([(per_tok[h] * mask[h]).sum() / mask[h].sum() for h in halves])
            assert abs(naive - want) > 1e-3  # negative control: the mean of micro-batch means differs
        else:
            want = np.mean([(per_tok[b] * mask[b]).sum() / mask[b].sum() for b in range(B)])
        assert float(ref[0][1]["policy_loss"]) == pytest.approx(want, rel=1e-5)
        assert abs(want) > 1e-3 and float(ref[0][1]["kl_ref"]) > 0 and float(ref[0][1]["entropy"]) > 0


# ------------------------------------------------------------------------------------------------ trainer pieces

def test_token_logprobs_and_values_are_read_one_position_earlier():
    rng = np.random.default_rng(0)
    B, S, D, V = 2, 7, 5, 11
    h = jnp.asarray(rng.normal(size=(B, S, D)).astype(np.float32))
    head = jnp.asarray(rng.normal(size=(D, V)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, V, (B, S)).astype(np.int32))
    lp, ent = token_logprobs(h, head, tokens, 0.7, chunk=4)  # chunk < S - 1: two chunks, one padded
    logits = np.einsum("bsd,dv->bsv", h, head) / 0.7
    full = jax.nn.log_softmax(logits, axis=-1)
    for i in range(1, S):
        np.testing.assert_allclose(lp[:, i], full[np.arange(B), i - 1, tokens[:, i]], rtol=1e-5)
        np.testing.assert_allclose(ent[:, i], -(np.exp(full[:, i - 1]) * full[:, i - 1]).sum(-1), rtol=1e-5)
    assert np.all(np.asarray(lp[:, 0]) == 0)


@pytest.mark.slow
def test_critic_values_alignment_and_zero_init(small_model):
    from glmjax.model import Batch
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 9)).astype(np.int32))
    batch = Batch(tok, jnp.ones_like(tok), jnp.broadcast_to(jnp.arange(9), (2, 9)))
    head = init_value_head(small_model.cfg.hidden_size)
    assert np.all(np.asarray(critic_values(small_model, head, batch, "sparse")) == 0)  # zero-initialised head
    w = jnp.asarray(np.random.default_rng(2).normal(size=small_model.cfg.hidden_size).astype(np.float32))
    v = critic_values(small_model, {"w": w, "b": jnp.float32(0.3)}, batch, "sparse")
    h, _ = small_model(batch, "sparse")
    want = np.einsum("bsd,d->bs", h, w) + 0.3
    np.testing.assert_allclose(v[:, 1:], want[:, :-1], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(v[:, 0]) == 0)


@pytest.mark.slow
def test_rl_trains_neither_the_indexer_nor_mtp():
    model = GLM(tiny(), nnx.Rngs(0))  # has MTP and indexers
    paths = lambda f: {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.split(model, f, ...)[1])}
    actor, critic = paths(ACTOR_TRAINABLE), paths(CRITIC_TRAINABLE)
    assert not any("indexer" in p or "mtp" in p for p in actor | critic)
    assert any("lm_head" in p for p in actor) and not any("lm_head" in p for p in critic)
    assert any("q_b_proj" in p for p in critic)


# ------------------------------------------------------------------------------------------------ sample hygiene

def mk_sample(group, version=5, status="ok", tag=0):
    return Sample(np.array([1]), np.array([2, 3]), np.ones(2, np.float32), np.zeros(2, np.float32), version, status,
                  group, float(tag), {"tool_calls": 0, "interceptions": []})


def test_filter_groups_drops_stale_and_crashed_and_pads_groups():
    samples = ([mk_sample(0, tag=i) for i in range(4)]  # complete
               + [mk_sample(1, tag=10), mk_sample(1, status="env_crash"), mk_sample(1, tag=12),
                  mk_sample(1, version=3, tag=13)]  # staleness 2 = max: valid -> 3 valid, padded by 1
               + [mk_sample(2, tag=20), mk_sample(2, version=2), mk_sample(2, status="env_crash"),
                  mk_sample(2, tag=23)]  # 2 valid of 4: not more than half -> dropped
               + [mk_sample(3, version=1), mk_sample(3, version=1), mk_sample(3, version=1),
                  mk_sample(3, status="truncated", tag=33)])  # truncated is valid, the rest stale -> dropped
    kept, c = filter_groups(samples, version=5, max_staleness=2, group_size=4)
    assert [s.reward for s in kept] == [0, 1, 2, 3, 10, 12, 13, 10]  # padding repeats valid samples in order
    assert c == {"samples_in": 16, "dropped_stale": 4, "dropped_env_crash": 2, "groups_padded": 1,
                 "samples_padded": 1, "groups_dropped": 2, "samples_dropped_with_group": 3}
    kept, c = filter_groups(samples[4:8], version=5, max_staleness=1, group_size=4)  # now v3 is stale: 2 valid
    assert kept == [] and c["groups_dropped"] == 1 and c["dropped_stale"] == 1


def test_rollout_worker_lag_weight_sync_and_errors():
    seen = []

    def produce(state, version):
        seen.append((state, version))
        time.sleep(0.01)
        return RolloutBatch([], version, 0.01, 0)

    w = RolloutWorker(produce, ahead=1)
    w.set_weights("w0", 0)
    w.start()
    got = []
    for v in range(1, 6):
        got.append(w.get().version)
        time.sleep(0.05)  # "training": the worker may finish only one batch ahead meanwhile
        w.set_weights(f"w{v}", v)
    w.stop()
    assert got[0] == 0 and all(v - g <= 1 for v, g in zip(range(1, 6), got[1:] + [5]))
    assert all(s == f"w{v}" for s, v in seen)  # each batch generated with one consistent (state, version)
    assert len(seen) <= 7

    def broken(state, version):
        raise ValueError("boom")

    w = RolloutWorker(broken)
    w.set_weights(None, 0)
    w.start()
    with pytest.raises(RuntimeError, match="rollout worker failed") as e:
        w.get()
    assert isinstance(e.value.__cause__, ValueError)
    w.stop()


# ------------------------------------------------------------------------------------------------ tasks, tools

def test_tasks_rewards_and_heldout_split():
    assert safe_eval("3*4+5") == 17 and safe_eval("2-3*2") == -4 and safe_eval("07") == 7
    for bad in ["", "3+", "1/2", "__import__('os')", "3**2"]:
        with pytest.raises(ValueError):
            safe_eval(bad)
    p = Problem("3+4=", "7")
    assert exact_reward(" 7", p) == 1 and exact_reward("77", p) == 0
    assert partial_reward("cba", Problem("rev:abc=", "cba")) == 1 and partial_reward("cbx", Problem("", "cba")) == 2 / 3
    rng = np.random.default_rng(0)
    for task in (Arithmetic(0, 9), Reverse(), Sort(), Arithmetic(0, 9, "*+")):
        train = {task.sample(rng).prompt for _ in range(200)}
        held = task.eval_set(30)
        assert held and not train & {q.prompt for q in held}
        assert all(task.is_heldout(q) for q in held)
        q = task.sample(rng)
        assert exact_reward(q.answer, q) == 1
    q = Sort().sample(rng)
    assert list(q.answer) == sorted(q.prompt[5:-1])
    assert Arithmetic(0, 9, "*+").sample(rng).prompt[1] == "*"


def test_interceptor_rules_and_judge():
    icpt = Interceptor()
    assert icpt.check(ToolCall("read", "answer.txt"))["rule"] == "protected_file"
    assert icpt.check(ToolCall("read", "tests/test_solution.py"))["blocked"]
    assert icpt.check(ToolCall("fetch", "https://x.org/solution"))["rule"] == "reference_solution"
    assert icpt.check(ToolCall("read", "notes.txt")) is None and icpt.check(ToolCall("calc", "1+2")) is None
    calls = []
    lenient = Interceptor(judge=lambda call, rule: calls.append((call, rule)) or call.arg != "answer.txt")
    rec = lenient.check(ToolCall("read", "answer.txt"))
    assert rec["judge"] == "overruled" and not rec["blocked"] and calls == [(ToolCall("read", "answer.txt"),
                                                                            "protected_file")]
    assert lenient.check(ToolCall("read", "expected_output"))["judge"] == "confirmed"


def test_tool_env_scripted_episodes():
    p = Problem("3*4+5=", "17")
    prompt, resp, mask = run_script(ToolEnv(p, exact_reward), use_calculator(p))
    assert decode(resp) == "calc:3*4+5\n=17\n17" and resp[-1] == EOS
    assert decode([t for t, m in zip(resp, mask) if m == 0]) == "=17\n"  # the tool output is loss-masked
    env = ToolEnv(p, exact_reward, Interceptor())
    run_script(env, read_answer_file(p))
    assert env.reward() == 0 and env.info["interceptions"][0]["rule"] == "protected_file"
    env = ToolEnv(p, exact_reward, None)  # negative control: without the interceptor the hack pays
    run_script(env, read_answer_file(p))
    assert env.reward() == 1


class ScriptedDecoder:
    """Stands in for glmjax.infer.Decoder: per row, logits that put all mass on the next token of a scripted
    policy(observations) -> turn text (the run_script convention), reconstructed from the tokens fed so far."""

    def __init__(self, policies, prompt_lens):
        self.policies, self.prompt_lens, self.state = policies, prompt_lens, None

    def init_cache(self, B, T):
        return [[] for _ in range(B)]

    def logits(self, hist):
        out = np.full((len(hist), 512), -1e9, np.float32)
        for b, h in enumerate(hist):
            if b >= len(self.policies):
                out[b, 0] = 0
                continue
            lines = bytes(t for t in h[self.prompt_lens[b]:] if t < 256).decode().split("\n")
            complete, partial = lines[:-1], lines[-1]
            obs = [line[1:] for line in complete[1::2]]
            turn = self.policies[b](obs)
            want = encode(turn) + ([] if turn.endswith("\n") else [EOS])
            out[b, want[min(len(partial.encode()), len(want) - 1)] if len(complete) % 2 == 0 else 0] = 0
        return jnp.asarray(out)

    def prefill(self, state, tokens, lengths, caches):
        hist = [list(np.asarray(tokens)[b, :lengths[b]]) for b in range(len(caches))]
        return self.logits(hist), hist

    def decode(self, state, tok, cur, hist):
        for b, t in enumerate(np.asarray(tok)):
            hist[b].append(int(t))
        return self.logits(hist), hist


def test_rollout_interceptor_blocks_and_the_episode_continues():
    problems = [Problem("3*4+5=", "17"), Problem("2*2+1=", "5"), Problem("1*1+1=", "2")]
    policies = [read_answer_file(problems[0]), use_calculator(problems[1]), read_answer_file(problems[2])]
    icpt = Interceptor()
    envs = [ToolEnv(problems[0], exact_reward, icpt), ToolEnv(problems[1], exact_reward, icpt),
            ToolEnv(problems[2], exact_reward, None)]
    lens = [len(e.prompt()) for e in envs]
    smp = Sampler(ScriptedDecoder(policies, lens), batch_size=4, max_prompt_len=8, max_response_len=40)
    s0, s1, s2 = smp.rollout(None, envs, [0, 0, 1], version=7, key=jax.random.key(0))
    # blocked: dummy output, then the policy still answered (copying the dummy) -> reward 0, status ok
    assert decode(s0.response) == "read:answer.txt\n=none\nnone" and s0.status == "ok"
    assert s0.reward == 0 and s0.intercepted and s0.info["interceptions"][0]["arg"] == "answer.txt"
    assert decode(s1.response) == "calc:2*2+1\n=5\n5" and s1.reward == 1 and not s1.intercepted
    assert s2.reward == 1  # negative control: no interceptor, the hack would pay
    obs = "=none\n"
    want_mask = [1] * len("read:answer.txt\n") + [0] * len(obs) + [1] * (len("none") + 1)
    np.testing.assert_array_equal(s0.loss_mask, want_mask)
    assert np.all(s0.logprobs[s0.loss_mask == 0] == 0) and np.allclose(s0.logprobs[s0.loss_mask == 1], 0, atol=1e-6)
    assert (s0.version, s0.group, s2.group) == (7, 0, 1)
    assert list(s0.prompt) == envs[0].prompt()


def test_rollout_statuses_crash_and_truncation():
    p = Problem("3*4+5=", "17")
    crash = ToolEnv(p, exact_reward, crash_prob=1.0)
    fine = SingleTurnEnv(Problem("1+1=", "2"), exact_reward)
    policies = [use_calculator(p), lambda obs: "2" * 30]
    smp = Sampler(ScriptedDecoder(policies, [len(crash.prompt()), len(fine.prompt())]), 2, 8, 14)
    a, b = smp.rollout(None, [crash, fine], [0, 1], 0, jax.random.key(0))
    assert a.status == "env_crash" and decode(a.response) == "calc:3*4+5\n"
    assert b.status == "truncated" and len(b.response) == 14 and b.reward == 0


@pytest.mark.slow
def test_truncated_rows_bootstrap_from_the_value_at_the_cut():
    """Hand-computed: policy tokens at 1, 2, all rewards 0, V = .5, .7, V at the cut .9, gamma .9, lam .8:
    delta_2 = .9 * .9 - .7 = .11 = A_2; delta_1 = .9 * .7 - .5 = .13, A_1 = .13 + .72 * .11 = .2092. A finished row
    (bootstrap 0) is the plain recursion; the packed path (`_gae_both`) reads the bootstrap from V after the row's
    last token for truncated rows only."""
    m = np.array([[0, 1, 1, 0]], np.float32)
    v = np.array([[9, .5, .7, 9]], np.float32)
    r = np.zeros_like(v)
    adv, ret = gae(r, v, m, 0.9, 0.8, np.array([.9], np.float32))
    np.testing.assert_allclose(adv[0], [0, .2092, .11, 0], atol=1e-6)
    np.testing.assert_allclose(ret[0], [0, .7092, .81, 0], atol=1e-6)
    np.testing.assert_allclose(gae(r, v, m, 0.9, 0.8, np.zeros(1, np.float32))[0], gae(r, v, m, 0.9, 0.8)[0])
    r, _, m = random_episode_arrays(3)
    B, T = m.shape
    after = np.random.default_rng(4).normal(size=(B, T)).astype(np.float32)  # V of the state after each token
    last = np.array([max(np.flatnonzero(m[b]), default=0) + (b == 2) for b in range(B)], np.int32)  # 2: env tail
    truncated = np.array([0, 1, 1, 0, 1], np.float32)
    alone = np.arange(B)[:, None]  # every row an episode of its own (no compaction)
    values, adv, ret = _gae_both(r, after, m, last, truncated, alone, 0.97, 0.9, 1.0)
    want_v = np.concatenate([np.zeros((B, 1), np.float32), after[:, :-1]], 1) * m  # V(s_i) = after[i - 1]
    np.testing.assert_array_equal(values, want_v)
    boot = after[np.arange(B), last] * truncated
    np.testing.assert_allclose(adv, naive_gae(r, want_v, m, 0.97, 0.9, boot)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, naive_gae(r, want_v, m, 0.97, 1.0, boot)[1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(adv[1], naive_gae(r, want_v, m, 0.97, 0.9)[0][1])  # the bootstrap matters


def test_rollout_logprobs_match_the_trainer(small_model):
    """Token in / token out: the trainer's log-probs of the stored tokens equal the sampler's (sparse attention,
    sequences longer than index_topk, so the deterministic top-k really selects), temperature applied to both."""
    model = small_model
    task = Arithmetic(0, 99, "*+")
    rng = np.random.default_rng(0)
    envs = [ToolEnv(task.sample(rng), exact_reward, Interceptor()) for _ in range(6)]
    smp = Sampler(Decoder(model, "sparse"), 6, 12, 20, temperature=0.8)
    state = nnx.state(model)
    samples = smp.rollout(state, envs, list(range(6)), 0, jax.random.key(3))
    data = pack_samples(samples, 8, 32, 258)
    graphdef, params, rest = nnx.split(model, ACTOR_TRAINABLE, ...)
    fns = PPOFunctions(graphdef, None, "sparse", 0.8, 512, PolicyLossConfig(), 0, 0, 0)
    logp = np.asarray(fns.logprobs(params, rest, {k: data[k] for k in ("tokens", "segment_ids", "positions")}))
    m = data["mask"] > 0
    assert m.sum() > 40 and (data["segment_ids"].sum(1) > model.cfg.index_topk).any()
    np.testing.assert_allclose(logp[m], data["rollout_logp"][m], atol=2e-4)
    # negative control: the trainer at temperature 1 disagrees
    fns1 = PPOFunctions(graphdef, None, "sparse", 1.0, 512, PolicyLossConfig(), 0, 0, 0)
    logp1 = np.asarray(fns1.logprobs(params, rest, {k: data[k] for k in ("tokens", "segment_ids", "positions")}))
    assert np.abs(logp1[m] - data["rollout_logp"][m]).max() > 1e-2
    # environment tokens carry no log-prob and no reward; the reward sits on the last policy token
    for b, s in enumerate(samples):
        last = len(s.prompt) + np.flatnonzero(s.loss_mask)[-1]
        assert data["rewards"][b, last] == s.reward and data["rewards"][b].sum() == s.reward
        assert data["last"][b] == len(s.prompt) + len(s.response) - 1  # the cut: after the row's last token
        assert data["truncated"][b] == (s.status == "truncated")


@pytest.mark.slow
def test_target_kl_stops_the_actor_updates_of_a_step(small_model):
    """The trust-region stop: with target_kl far below the KL one update causes, a PPO step applies exactly one
    actor update (the first mini-batch is measured at pi_old itself: KL 0) and skips the rest, while the critic
    trains on every mini-batch; without target_kl all ppo_epochs x minibatches updates run. The skipped updates
    really are not applied: the stopped learner's weights equal those after a single-update step."""
    from glmjax.optim.config import default_optim_config
    from glmjax.rl.ppo import Learner

    task = Arithmetic(0, 9, "+")
    rng = np.random.default_rng(0)
    envs = [SingleTurnEnv(task.sample(rng), exact_reward) for _ in range(8)]
    smp = Sampler(Decoder(small_model, "sparse"), 8, 6, 4)
    samples = smp.rollout(nnx.state(small_model), envs, [i // 4 for i in range(8)], 0, jax.random.key(1))
    for s in samples[::3]:  # an untrained model solves nothing: give some samples a reward to learn from
        s.reward = 1.0
    optim = {**default_optim_config(name="adamw", lr=1e-3, warmup_steps=0, weight_decay=0.0).to_dict(),
             "total_steps": 10}

    def step(**ppo):
        p = default_ppo_config(**{"ppo_epochs": 2, "minibatches": 2, **ppo})
        learner = Learner(small_model, p, optim, {**optim, "lr": 1e-3}, 258)
        m = learner.update(samples, 0, 8, 10, train_actor=True)
        return learner, m

    free, m_free = step(target_kl=None)
    assert m_free["actor_updates"] == 4 and not m_free["kl_stopped"] and m_free["approx_kl_old"] > 1e-6
    stopped, m_stop = step(target_kl=1e-9)
    assert m_stop["actor_updates"] == 1 and m_stop["kl_stopped"]
    equal = lambda a, b: jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b))  # noqa: E731
    assert not equal(stopped.params, free.params)
    # the same first mini-batch (same permutation) in a step of 1 epoch x 2 mini-batches, stopped after it: the
    # weights are bitwise those of the 2 x 2 step stopped after its first update -- nothing was applied later
    first, m_first = step(ppo_epochs=1, target_kl=1e-9)
    assert m_first["actor_updates"] == 1 and equal(stopped.params, first.params)
    assert equal(stopped.cparams, free.cparams)  # the critic took all four updates, as without the stop


@pytest.mark.slow
def test_truncated_rows_are_terminal_by_default_and_bootstrap_on_request(small_model):
    """ppo.truncation through the Learner: with gamma = lam_critic = 1 the critic's return at every policy token of
    a terminal row is the row's score (closed form); "bootstrap" adds V at the cut to the truncated rows only."""
    from glmjax.optim.config import default_optim_config
    from glmjax.rl.ppo import Learner

    task = Arithmetic(0, 9, "+")
    rng = np.random.default_rng(0)
    envs = [SingleTurnEnv(task.sample(rng), exact_reward) for _ in range(8)]
    samples = Sampler(Decoder(small_model, "sparse"), 8, 6, 4).rollout(nnx.state(small_model), envs,
                                                                        [i // 4 for i in range(8)], 0, jax.random.key(1))
    for i, s in enumerate(samples):
        s.reward, s.status = float(i % 3 == 0), ("truncated" if i % 2 else "ok")
    optim = {**default_optim_config(name="adamw", lr=1e-3, warmup_steps=0, weight_decay=0.0).to_dict(),
             "total_steps": 10}
    returns = {}
    for mode in ("terminal", "bootstrap"):
        learner = Learner(small_model, default_ppo_config(truncation=mode, lam_critic=1.0, whiten_advantages=False),
                          optim, optim, 258)
        backbone, head = learner.cparams  # the head starts at 0 (V = 0): give it weights so that V at the cut is not
        head = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), head)
        learner.cparams = (backbone, head)
        data = pack_samples(samples, 8, 10, 258)
        learner.advantages(data, {k: data[k] for k in ("tokens", "segment_ids", "positions")})
        returns[mode], mask = data["returns"], data["mask"] > 0
    score = np.array([s.reward for s in samples], np.float32)
    cut = np.array([s.status == "truncated" for s in samples])
    np.testing.assert_allclose(returns["terminal"], np.where(mask, score[:, None], 0), atol=1e-6)
    np.testing.assert_allclose(returns["bootstrap"][~cut], returns["terminal"][~cut], atol=1e-6)
    shift = (returns["bootstrap"] - returns["terminal"])[cut]
    assert (np.abs(shift[mask[cut]]) > 1e-4).all()  # V at the cut, the same at every token of the row (gamma 1)


# ------------------------------------------------------------------------------------------------ config

def ppo_config(**ppo):
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()  # ModelConfig defaults
    c.ppo = default_ppo_config(**ppo)
    return c


@pytest.mark.parametrize("field,value,match", [
    ("policy_loss", "ppo", r"ppo.policy_loss='ppo': must be one of"),
    ("clip_low", 1.5, r"ppo.clip_low=1.5: must be <= 1"),
    ("dual_clip", 0.9, r"ppo.dual_clip=0.9: must be > 1"),
    ("step_kl_per_nat", 0.0, r"ppo.step_kl_per_nat=0.0: must be > 0"),
    ("truncation", "drop", r"ppo.truncation='drop': must be one of \['terminal', 'bootstrap'\]"),
    ("group_size", 0, r"ppo.group_size=0: must be an integer >= 1"),
    ("micro_batches", 3, r"ppo.prompts_per_step=16: x group_size = 64 rows per step must be divisible"),
    ("max_response_len", 300, r"ppo.max_response_len=300: max_prompt_len \+ max_response_len"),
    ("freeze_indexer", False, r"ppo.freeze_indexer=False: must be True"),
    ("data_parallel", 64, r"ppo.data_parallel=64: needs that many devices"),
    ("lam_actor", 1.2, r"ppo.lam_actor=1.2: must be <= 1"),
    ("env_crash_prob", 0.1, r"ppo.env_crash_prob=0.1: simulated crashes happen in tool calls"),
])
def test_config_validation(field, value, match):
    with pytest.raises(ConfigError, match=match):
        validate_ppo_config(ppo_config(**{field: value}))


def test_config_validation_misc():
    assert validate_ppo_config(ppo_config()).num_hidden_layers == 6
    from configs import ppo_tiny
    assert validate_ppo_config(ppo_tiny.get_config()).num_nextn_predict_layers == 0
    c = ppo_config()
    c.ppo.bogus = 1
    with pytest.raises(ConfigError, match="ppo.bogus: unknown field"):
        validate_ppo_config(c)
    with pytest.raises(ConfigError, match="ppo.group_size=1: GRPO needs groups"):
        validate_ppo_config(ppo_config(advantage="grpo", group_size=1))
    from glmjax.rl.ppo import build_task
    with pytest.raises(ConfigError, match="ppo.task_args"):
        build_task(ppo_config(task_args={"nope": 1}).ppo)
    with pytest.raises(ConfigError, match=r"ppo.task_args.low=5, high=2"):
        build_task(ppo_config(task_args={"low": 5, "high": 2}).ppo)
    from glmjax.rl.tasks import REWARDS, resolve_callable
    with pytest.raises(ConfigError, match="ppo.reward='nope'"):
        resolve_callable("nope", REWARDS, "reward")
    assert resolve_callable("glmjax.rl.tasks:exact_reward", REWARDS, "reward") is exact_reward


def test_step_kl_per_nat_scales_the_actor_lr_by_the_root_of_the_kl_to_budget_ratio_within_bounds():
    """ppo.step_kl_per_nat's rule, by hand: after a step the actor's lr multiplier is multiplied by sqrt(budget / the
    largest KL measured in it), budget = step_kl_per_nat x min(pi_old's entropy, the entropy at the first measured
    step), bounded to [1/4, 3/2] per step and to at most 1; a step with no measurement (one update, or the critic's
    warm-up) or step_kl_per_nat=None leaves it."""
    from types import SimpleNamespace

    from glmjax.rl.ppo import Learner

    learner = SimpleNamespace(p=SimpleNamespace(step_kl_per_nat=0.05), lr_scale=1.0, entropy_start=None)
    seen = []
    for kl, ent in (([0.04], 0.2), ([0.02, 0.16], 0.2), ([0.0025], 0.2), ([0.0], 0.2), ([], 0.2), ([0.01], 0.2),
                    ([0.00000001], 0.2), ([0.5], 0.2), ([0.04], 3.2), ([0.0025], 0.05)):
        Learner.adapt_lr(learner, kl, ent)
        seen.append(learner.lr_scale)
    # budget 0.05 x 0.2 = 0.01. 0.04: sqrt(1/4) = 0.5; max 0.16: sqrt(1/16) = 0.25; 0.0025: x2 -> bounded to x1.5;
    # 0.0: x1.5; none: kept; on budget: kept; tiny KL: x1.5 but never above 1; 0.5: sqrt(1/50) -> bounded to x0.25;
    # entropy 3.2 (blown up) keeps the first step's 0.2: 0.04 -> x0.5; entropy 0.05 (sharper): budget 0.0025, kept
    assert seen == pytest.approx([0.5, 0.125, 0.1875, 0.28125, 0.28125, 0.28125, 0.421875, 0.10546875, 0.052734375,
                                  0.052734375])
    assert learner.entropy_start == 0.2
    for _ in range(8):  # 0.053 x 1.5^8 = 1.35
        Learner.adapt_lr(learner, [0.0], 0.2)
    assert learner.lr_scale == 1.0
    learner.p.step_kl_per_nat = None
    Learner.adapt_lr(learner, [1.0], 0.2)
    assert learner.lr_scale == 1.0


def test_step_kl_per_nat_meets_its_budget_at_the_next_steps_scheduled_lr():
    """During the lr warm-up a step's KL comes from a smaller lr than the next step's: the factor is multiplied by
    this step's mean scheduled lr over the next step's, by hand on a 10-update linear warm-up (lr/peak = count / 10)
    with 4 updates per PPO step."""
    from types import SimpleNamespace

    from glmjax.optim import make_schedule
    from glmjax.rl.ppo import Learner

    learner = SimpleNamespace(p=SimpleNamespace(step_kl_per_nat=0.05, ppo_epochs=2, minibatches=2), lr_scale=1.0,
                              entropy_start=None, actor_count=0, schedule=make_schedule(1.0, 10, 600, "cosine", 0.1))
    # step 1 applied updates 0-3 (0, .1, .2, .3: mean .15), step 2 will apply 4-7 (mean .55); stopped after 2
    # updates (0, .1: mean .05), step 2 will apply 2-5 (mean .35)
    assert Learner.schedule_ratio(learner, 4) == pytest.approx(0.15 / 0.55)
    assert Learner.schedule_ratio(learner, 2) == pytest.approx(0.05 / 0.35)
    assert Learner.schedule_ratio(learner, 0) == 1.0
    learner.actor_count = 40  # past the warm-up: the cosine decays by under 1% over one step
    assert Learner.schedule_ratio(learner, 4) == pytest.approx(1.0, abs=0.01) and Learner.schedule_ratio(learner, 4) > 1
    # on budget (0.05 x 0.2) at a quarter-size step: the next full-size step would cause 1/ratio^2 the budget
    Learner.adapt_lr(learner, [0.01], 0.2, 0.15 / 0.55)
    assert learner.lr_scale == pytest.approx(0.15 / 0.55)
    # far under budget during the warm-up: x sqrt(100) x 0.27 = 2.7, bounded to x1.5
    Learner.adapt_lr(learner, [0.0001], 0.2, 0.15 / 0.55)
    assert learner.lr_scale == pytest.approx(1.5 * 0.15 / 0.55)
