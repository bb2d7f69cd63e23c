"""Advantages of a compacted episode's sub-trajectories (issue 47, docs/ppo.md "Compaction"): GAE along the whole
episode (the last policy token of sub-trajectory j bootstraps from V at the first policy token of j+1) against a
hand computation and against `gae` on the uncompacted episode (identical advantages when compaction keeps
everything), a reward reaches no token twice; the batch places the reward once (or split, segment_advantage=
"independent"); GRPO counts an episode once in its group."""
import numpy as np
import pytest

from glmjax.rl.advantages import episode_gae, episode_grpo, episode_rows, gae, grpo
from glmjax.rl.ppo import pack_samples
from glmjax.rl.rollout import Sample


def test_two_sub_trajectories_by_hand():
    """Row 0: prompt, a1, a2. Row 1 (its prompt: the compacted history), an observation, b1 with the reward."""
    g, lam, r = 0.9, 0.5, 2.0
    mask = np.array([[0, 1, 1, 0], [0, 0, 0, 1]], np.float32)
    values = np.array([[7, .1, .4, 7], [7, 7, 7, .3]], np.float32)  # 7: states no policy token starts from
    rewards = np.zeros((2, 4), np.float32)
    rewards[1, 3] = r
    adv, ret = episode_gae(rewards, values, mask, episode_rows([5, 5], [0, 1]), g, lam)
    a3 = r - .3
    a2 = g * .3 - .4 + g * lam * a3
    a1 = g * .4 - .1 + g * lam * a2
    np.testing.assert_allclose(np.asarray(adv), [[0, a1, a2, 0], [0, 0, 0, a3]], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), (np.asarray(adv) + values) * mask, rtol=1e-6, atol=1e-6)
    alone, _ = gae(rewards, values, mask, g, lam)  # each row its own GAE: row 0 sees no reward, no value after it
    assert float(alone[0, 2]) == pytest.approx(-.4)


def split(tokens_mask, cuts, prompt_len):
    """An uncompacted row's mask -> sub-trajectory rows: segment j holds a prompt of `prompt_len` non-policy tokens
    (the compacted history) and the tokens [cuts[j], cuts[j+1]) -> (masks [K, T], positions: for each segment the
    original index of each of its tokens, -1 in its prompt)."""
    bounds = [0, *cuts, len(tokens_mask)]
    T = prompt_len + max(b - a for a, b in zip(bounds, bounds[1:]))
    masks, where = np.zeros((len(bounds) - 1, T), np.float32), np.full((len(bounds) - 1, T), -1)
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        masks[j, prompt_len:prompt_len + b - a] = tokens_mask[a:b]
        where[j, prompt_len:prompt_len + b - a] = np.arange(a, b)
    return masks, where


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_compaction_that_keeps_everything_changes_no_advantage(gamma, lam):
    rng = np.random.default_rng(0)
    T = 40
    m = (rng.random(T) < 0.6).astype(np.float32)  # policy tokens among tool observations
    m[0] = 0
    v = rng.normal(size=T).astype(np.float32)
    r = np.zeros(T, np.float32)
    r[np.flatnonzero(m)[-1]] = 1.5
    want_adv, want_ret = (np.asarray(x)[0] for x in gae(r[None], v[None], m[None], gamma, lam))
    masks, where = split(m, [11, 19, 30], prompt_len=5)
    pick = lambda x: np.where(where >= 0, x[np.maximum(where, 0)], 0).astype(np.float32)  # noqa: E731
    rows = np.array([3, 1, 0, 2])  # the batch holds the sub-trajectories out of order, beside another episode
    K = len(masks)
    batch = {k: np.zeros((K + 1, masks.shape[1]), np.float32) for k in ("r", "v", "m")}
    batch["m"][rows], batch["v"][rows], batch["r"][rows] = masks, pick(v) * masks, pick(r) * masks
    batch["m"][4, 2:6] = 1
    batch["v"][4, 2:6] = .5
    batch["r"][4, 5] = -1.0
    episode, segment = np.zeros(K + 1, int), np.zeros(K + 1, int)
    episode[rows], segment[rows] = 7, np.arange(K)
    episode[4] = 8
    adv, ret = episode_gae(batch["r"], batch["v"], batch["m"], episode_rows(episode, segment), gamma, lam)
    adv, ret = np.asarray(adv), np.asarray(ret)
    for j, row in enumerate(rows):
        keep = where[j] >= 0
        np.testing.assert_allclose(adv[row, keep], want_adv[where[j, keep]], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret[row, keep], want_ret[where[j, keep]], rtol=1e-5, atol=1e-6)
    single, _ = gae(batch["r"][4:], batch["v"][4:], batch["m"][4:], gamma, lam)  # the other episode: unchained
    np.testing.assert_allclose(adv[4], np.asarray(single)[0], rtol=1e-6)


def test_a_reward_reaches_no_token_twice():
    """gamma = lam = 1, V = 0: every policy token's advantage is the episode's reward, once."""
    mask = np.array([[0, 1, 1], [0, 1, 0], [0, 0, 1]], np.float32)
    rewards = np.zeros((3, 3), np.float32)
    rewards[2, 2] = 1.0
    adv, _ = episode_gae(rewards, np.zeros((3, 3), np.float32), mask, episode_rows([0, 0, 0], [0, 1, 2]), 1.0, 1.0)
    np.testing.assert_array_equal(np.asarray(adv), mask)


def test_episode_rows():
    np.testing.assert_array_equal(episode_rows([4, 9, 4, 4], [2, 0, 0, 1]), [[2, 3, 0], [1, -1, -1]])
    with pytest.raises(ValueError, match=r"episode 4: sub-trajectory indices \[0, 2\]"):
        episode_rows([4, 4], [0, 2])


def sample(episode, segment, n_policy, reward, group=0):
    resp = np.arange(1, n_policy + 2, dtype=np.int32)
    mask = np.r_[np.ones(n_policy, np.float32), 0]  # a trailing observation token
    return Sample(np.array([9, 9], np.int32), resp, mask, np.zeros(n_policy + 1, np.float32), 0, "ok", group, reward,
                  {}, episode, segment)


@pytest.mark.parametrize("scheme", ["episode", "independent"])
def test_the_batch_places_an_episodes_reward_once(scheme):
    samples = [sample(4, 2, 2, 0.9), sample(4, 0, 3, 0.9), sample(-1, 0, 2, 0.5), sample(4, 1, 1, 0.9)]
    data = pack_samples(samples, 5, 8, 0, scheme)
    np.testing.assert_array_equal(data["episode"][:4], [4, 4, -3, 4])
    np.testing.assert_array_equal(data["segment"][:4], [2, 0, 0, 1])
    assert len(set(data["episode"].tolist())) == 3  # padding rows and the plain sample: episodes of their own
    last_policy = {0: 3, 1: 4, 2: 3, 3: 2}  # prompt of 2, then the policy tokens
    want = {"episode": {0: 0.9, 1: 0.0, 2: 0.5, 3: 0.0}, "independent": {0: 0.3, 1: 0.3, 2: 0.5, 3: 0.3}}[scheme]
    for row, t in last_policy.items():
        np.testing.assert_allclose(data["rewards"][row, t], want[row], rtol=1e-6)
        assert data["rewards"][row].sum() == pytest.approx(want[row])
    assert data["rewards"].sum() == pytest.approx(1.4)  # the episode's 0.9 once, and the plain sample's 0.5


def test_grpo_counts_a_compacted_episode_once():
    """Group 0: episode A (3 sub-trajectories, reward 1) and episode B (1 row, reward 0): A's advantage is that of a
    group {1, 0}, not of {1, 1, 1, 0}."""
    scores, groups = np.array([1, 1, 1, 0], np.float32), np.zeros(4, int)
    mask = np.ones((4, 2), np.float32)
    adv = episode_grpo(scores, groups, episode_rows([0, 0, 0, 1], [0, 1, 2, 0]), mask)
    np.testing.assert_allclose(adv[:, 0], [1, 1, 1, -1], atol=1e-5)
    rowwise = np.asarray(grpo(scores, groups, mask))
    assert not np.allclose(rowwise, adv)  # per row, the three sub-trajectories would outvote B
    alone = episode_rows(np.arange(4), np.zeros(4, int))  # no compaction: exactly grpo
    np.testing.assert_array_equal(episode_grpo(scores, groups, alone, mask), rowwise)


def test_a_truncated_compacted_episode_bootstraps_from_its_last_row():
    """The learner's path (`_gae_both`): the episode's bootstrap is V after the last token of its last row; a flag
    on another row of the episode is not read."""
    from glmjax.rl.ppo import _gae_both

    rng = np.random.default_rng(5)
    mask = np.array([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]], np.float32)
    after = rng.normal(size=(2, 5)).astype(np.float32)
    rewards = np.zeros((2, 5), np.float32)
    last, chains = np.array([2, 4], np.int32), np.array([[1, 0]])[:, ::-1].copy()  # row 0 then row 1
    values, adv, _ = _gae_both(rewards, after, mask, last, np.array([1, 1], np.float32), chains, 0.9, 0.8, 1.0)
    want, _ = episode_gae(rewards, values, mask, chains, 0.9, 0.8, np.array([after[1, 4]], np.float32))
    np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-7)
    assert abs(float(adv[1, 3])) > 0 and not np.allclose(adv, episode_gae(rewards, values, mask, chains, 0.9, 0.8,
                                                                          np.array([after[0, 2]], np.float32))[0])
