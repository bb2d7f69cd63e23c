"""Rollouts: a lockstep sampler over the MLA-cache decoder, sample hygiene, and the asynchronous rollout worker.

Token in / token out: a Sample stores exactly the token ids the sampler fed to the model -- prompt, sampled policy
tokens and environment observations in order -- with the sampler's log-prob of every policy token (temperature
applied, as `glmjax.infer.sample` reports it), so the trainer never re-tokenises or re-renders anything.

The sampler drives `Decoder.prefill` / `Decoder.decode` itself (rather than `generate`) because environment
observations must be fed into the same cache mid-episode: each step, every row either samples its next token or,
while it has observation tokens queued, is fed the next of those (loss mask 0). Shapes are fixed (batch, prompt
bucket, capacity), so nothing recompiles between batches or weight versions.
"""
from __future__ import annotations

import dataclasses
import queue
import sys
import threading
from collections import defaultdict
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.infer import Decoder, sample
from glmjax.rl.compaction import COMPACT
from glmjax.rl.env import EnvCrash, SingleTurnEnv

STATUSES = ("ok", "truncated", "env_crash", "compacted")


@dataclasses.dataclass
class Sample:
    prompt: np.ndarray  # [p] int32
    response: np.ndarray  # [r] int32: policy and environment tokens, in the order the model saw them
    loss_mask: np.ndarray  # [r] f32: 1 on policy tokens, 0 on environment / tool tokens
    logprobs: np.ndarray  # [r] f32: the sampler's log-prob of each policy token (0 on environment tokens)
    version: int  # policy weight version that generated it
    status: str  # "ok" | "truncated" (hit max_response_len) | "env_crash" | "compacted" (the episode goes on in
    # the next sub-trajectory: `play_episodes`)
    group: int  # samples of one prompt share a group id
    reward: float  # the episode's reward (every sub-trajectory of a compacted episode carries it)
    info: dict  # {"tool_calls": n, "interceptions": [records]}
    episode: int = -1  # sub-trajectories of one compacted episode share an id (>= 0); -1: an episode of its own
    segment: int = 0  # the sub-trajectory's index within its episode

    @property
    def intercepted(self) -> bool:
        return any(r["blocked"] for r in self.info.get("interceptions", ()))


class Sampler:
    """Batched episodes with fixed shapes: `batch_size` rows, prompts padded to `max_prompt_len`, at most
    `max_response_len` response tokens (policy + environment) per row."""

    def __init__(self, decoder: Decoder, batch_size: int, max_prompt_len: int, max_response_len: int,
                 temperature: float = 1.0, top_p: float = 1.0, pad_id: int = 0):
        self.decoder, self.B = decoder, batch_size
        self.P, self.R = max_prompt_len, max_response_len
        self.temperature, self.top_p, self.pad_id = float(temperature), float(top_p), pad_id

    def rollout(self, state, envs: Sequence[SingleTurnEnv], groups: Sequence[int], version: int,
                key: jax.Array) -> list[Sample]:
        """Play len(envs) <= batch_size episodes with the decoder weights `state` -> one Sample per env."""
        n = len(envs)
        if not 0 < n <= self.B or len(groups) != n:
            raise ValueError(f"rollout: {n} envs / {len(groups)} groups for batch size {self.B}")
        prompts = [list(env.prompt()) for env in envs]
        too_long = [len(p) for p in prompts if not 0 < len(p) <= self.P]
        if too_long:
            raise ValueError(f"prompt of {too_long[0]} tokens: must be 1..max_prompt_len={self.P}")
        prompts += [prompts[0]] * (self.B - n)  # filler rows keep the batch shape; their results are discarded
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens = np.full((self.B, self.P), self.pad_id, np.int32)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        dec = self.decoder
        caches = dec.init_cache(self.B, self.P + self.R)
        logits, caches = dec.prefill(state, jnp.asarray(tokens), jnp.asarray(lengths), caches)
        cur = jnp.asarray(lengths)
        # Per row: response tokens / loss mask / log-probs so far, observation tokens still to feed, where the
        # current policy turn started. Bookkeeping is vectorised; Python runs per event (a stop token, an
        # observation token), not per row and token -- it shares the interpreter with the trainer thread.
        resp = np.zeros((n, self.R), np.int32)
        mask = np.zeros((n, self.R), np.float32)
        lps = np.zeros((n, self.R), np.float32)
        pos = np.zeros(n, np.int64)
        queued: list[list[int]] = [[] for _ in range(n)]
        turn_start = np.zeros(n, np.int64)
        status: list[str | None] = [None] * n
        live = np.ones(n, bool)
        stops = np.zeros((n, logits.shape[-1]), bool)
        for b, env in enumerate(envs):
            stops[b, list(env.stop_tokens)] = True
        for i in range(self.R):
            key, sub = jax.random.split(key)
            tok, lp = sample(logits, sub, temperature=self.temperature, top_p=self.top_p)
            tok, lp = np.array(tok), np.asarray(lp)
            feeding = np.array([bool(q) for q in queued]) & live
            policy = np.flatnonzero(live & ~feeding)
            resp[policy, pos[policy]] = tok[policy]
            mask[policy, pos[policy]] = 1.0
            lps[policy, pos[policy]] = lp[policy]
            pos[policy] += 1
            for b in np.flatnonzero(feeding):  # environment tokens: fed to the model, loss mask 0
                tok[b] = resp[b, pos[b]] = queued[b].pop(0)
                pos[b] += 1
                if not queued[b]:
                    turn_start[b] = pos[b]
            for b in policy[stops[policy, tok[policy]]]:  # end of a policy turn: the environment answers
                try:
                    obs = envs[b].step(resp[b, turn_start[b]:pos[b]].tolist())
                except EnvCrash:
                    status[b], live[b] = "env_crash", False
                    continue
                if obs is COMPACT:  # compaction.py: the episode goes on from the compacted prompt (`play_episodes`)
                    status[b], live[b] = "compacted", False
                    continue
                if obs is None:
                    status[b], live[b] = "ok", False
                elif obs:
                    queued[b] = list(obs)
                else:
                    turn_start[b] = pos[b]
            if not live.any() or i == self.R - 1:
                break
            logits, caches = dec.decode(state, jnp.asarray(tok), cur, caches)
            cur = cur + 1
        out = []
        for b in range(n):
            st = status[b] or "truncated"
            k = pos[b]
            out.append(Sample(np.asarray(prompts[b], np.int32), resp[b, :k].copy(), mask[b, :k].copy(),
                              lps[b, :k].copy(), version, st, int(groups[b]),
                              envs[b].reward() if st not in ("env_crash", "compacted") else 0.0, envs[b].info))
        return out

    def play_episodes(self, state, envs: Sequence[SingleTurnEnv], groups: Sequence[int], version: int,
                      key: jax.Array, max_pieces: int = 8) -> list[Sample]:
        """`rollout` for environments that may compact (compaction.py): the envs that compacted play on from their
        compacted prompts, until each episode ends or has played `max_pieces` sub-trajectories (its last then
        counts as truncated). -> every sub-trajectory as a Sample, by episode (the env's index) and segment, each
        carrying its episode's reward; the final one carries its status. Without compaction: `rollout`'s samples,
        with the same key."""
        out, live = [], list(range(len(envs)))
        for piece in range(max_pieces):
            samples = self.rollout(state, [envs[i] for i in live], [groups[i] for i in live], version,
                                   key if piece == 0 else jax.random.fold_in(key, piece))
            for i, s in zip(live, samples):
                s.episode, s.segment = i, piece
            out += samples
            live = [i for i, s in zip(live, samples) if s.status == "compacted"]
            if not live:
                break
        final = {s.episode: s for s in out}  # appended in segment order: the last wins
        for s in final.values():
            if s.status == "compacted":  # max_pieces reached
                s.status = "truncated"
        for s in out:
            s.reward = final[s.episode].reward
        return sorted(out, key=lambda s: (s.episode, s.segment))


def filter_groups(samples: Sequence[Sample], version: int, max_staleness: int, group_size: int):
    """GLM-5's sample hygiene, by episode (the sub-trajectories of a compacted episode are one: `play_episodes`). An
    episode is invalid if its environment crashed or it is more than `max_staleness` versions older than
    `version`. A group with more than half of `group_size` valid episodes is kept and padded back to `group_size`
    by repeating its valid episodes in order (a repeated compacted episode under a new episode id); any other group
    is dropped whole. Counts are of samples. -> (kept samples, counts)."""
    by_group: dict[int, dict] = defaultdict(dict)
    for k, s in enumerate(samples):
        by_group[s.group].setdefault(s.episode if s.episode >= 0 else -1 - k, []).append(s)
    counts = dict.fromkeys(["samples_in", "dropped_stale", "dropped_env_crash", "groups_padded", "samples_padded",
                            "groups_dropped", "samples_dropped_with_group"], 0)
    counts["samples_in"] = len(samples)
    kept, fresh = [], max((s.episode for s in samples), default=-1) + 1
    for g, episodes in by_group.items():
        valid = []
        for pieces in episodes.values():
            if any(s.status == "env_crash" for s in pieces):
                counts["dropped_env_crash"] += len(pieces)
            elif version - pieces[0].version > max_staleness:
                counts["dropped_stale"] += len(pieces)
            else:
                valid.append(pieces)
        if 2 * len(valid) > group_size:
            missing = max(group_size - len(valid), 0)
            if missing > 0:
                counts["groups_padded"] += 1
            for pieces in valid:
                kept += pieces
            for i in range(missing):
                pieces = valid[i % len(valid)]
                if pieces[0].episode >= 0:  # a copy of a compacted episode: an episode of its own
                    pieces, fresh = [dataclasses.replace(s, episode=fresh) for s in pieces], fresh + 1
                kept += pieces
                counts["samples_padded"] += len(pieces)
        else:
            counts["groups_dropped"] += 1
            counts["samples_dropped_with_group"] += sum(len(p) for p in valid)
    return kept, counts


@dataclasses.dataclass
class RolloutBatch:
    samples: list[Sample]
    version: int  # weight version used for the whole batch
    generate_s: float  # wall time spent generating it
    tokens: int  # response tokens generated (policy + environment)
    # the producer's random streams once the batch was drawn (JSON): what a checkpoint after training on this batch
    # stores, so a resumed run draws the problems and samples of the next batch as an uninterrupted one would
    rng_after: dict | None = None


class RolloutWorker:
    """A thread that keeps generating rollout batches with the latest weights it was given, while the trainer
    trains. Weight sync: the trainer calls `set_weights(state, version)` after each update; the worker picks the
    newest weights up right before it starts a batch (a batch is generated with one version throughout). It starts a
    batch only while fewer than `ahead` finished batches wait for the trainer, so with ahead = 1 the trainer at
    version v trains on a batch generated by version v-1 (one step of lag, as in slime). An exception in the worker
    is re-raised by `get`."""

    def __init__(self, produce: Callable[[object, int], RolloutBatch], ahead: int = 1):
        self.produce = produce
        self.queue: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(ahead)
        self.lock = threading.Lock()
        self.weights = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)

    def set_weights(self, state, version: int):
        with self.lock:
            self.weights = (state, version)

    def start(self):
        if self.weights is None:
            raise RuntimeError("set_weights before start")
        self.thread.start()

    def _run(self):
        try:
            while not self.stopping.is_set():
                if not self.slots.acquire(timeout=0.1):
                    continue
                with self.lock:
                    state, version = self.weights
                self.queue.put(self.produce(state, version))
        except BaseException as e:  # surfaced to the trainer by get()
            self.error = e

    def get(self) -> RolloutBatch:
        while True:
            try:
                batch = self.queue.get(timeout=0.1)
                self.slots.release()
                return batch
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError(f"rollout worker failed: {type(self.error).__name__}: {self.error}") \
                        from self.error
                if not self.thread.is_alive():
                    raise RuntimeError("rollout worker stopped")

    def stop(self):
        """Stop after the batch being generated and wait for it (at most 60 s): the thread runs JAX code, which must
        not still be running when the interpreter shuts down (glmjax/data/read_ahead.py: an abort at exit)."""
        self.stopping.set()
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            print("ppo: the rollout worker is still generating after 60 s; left behind", file=sys.stderr)
