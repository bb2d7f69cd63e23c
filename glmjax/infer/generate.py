"""`generate`: batched prompts of different lengths -> sampled tokens and their log-probabilities; with
`speculative=d`, greedy speculative decoding drafted by the MTP layer (glmjax/infer/speculative.py)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.infer.decode import Decoder, sample
from glmjax.infer.speculative import SpeculativeDecoder, validate_depth


class Generation(NamedTuple):
    tokens: np.ndarray  # [B, N] int32 generated tokens (pad_id after a row stopped)
    logprobs: np.ndarray  # [B, N] f32 log-prob of each generated token (0 after a row stopped)
    lengths: np.ndarray  # [B] number of generated tokens per row, including the stop token
    steps: np.ndarray | None = None  # [B] main-model passes after the prefill that produced the row's tokens


def speculator(decoder: Decoder, depth: int) -> SpeculativeDecoder:
    """The decoder's SpeculativeDecoder of `depth` drafts, built once (its jitted programs are reused), kept in
    `decoder.speculators`."""
    if validate_depth(depth) not in decoder.speculators:
        decoder.speculators[depth] = SpeculativeDecoder(decoder, depth)
    return decoder.speculators[depth]


def generate(decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, key: jax.Array,
             temperature: float = 0.0, top_p: float = 1.0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
             max_len: int | None = None, speculative: int = 0) -> Generation:
    """Prefill all prompts (right-padded), then decode token by token until every row hit a stop token or
    max_new_tokens. `key` drives sampling (one split per step); temperature 0 is greedy. max_len: the cache
    capacity (default: longest prompt + max_new_tokens (+ speculative), rounded up to `decoder.cache_multiple`).
    speculative=d > 0: rounds of d tokens drafted by the MTP layer and verified in one pass (greedy only: the
    output equals plain greedy decoding's)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
    if speculative and temperature != 0:
        raise ValueError(f"speculative={speculative} decodes greedily: temperature must be 0 (got {temperature})")
    spec = speculator(decoder, speculative) if speculative else None
    tokens, lengths, max_len = prompt_batch(decoder, prompts, max_new_tokens, pad_id, max_len, extra=speculative)
    out = Output(len(prompts), max_new_tokens, stop_tokens, pad_id)
    if spec is not None:
        caches, mtp_cache = spec.init_cache(len(prompts), max_len)
        x0, logp, r, caches, mtp_cache = spec.prefill(decoder.state, jnp.asarray(tokens), jnp.asarray(lengths),
                                                      caches, mtp_cache)
        out.add(np.asarray(x0)[:, None], np.asarray(logp)[:, None])
        while not out.done.all():
            emitted, logp, acc, r, caches, mtp_cache = spec.round(decoder.state, r, caches, mtp_cache)
            out.add(np.asarray(emitted), np.asarray(logp), np.asarray(acc) + 1)
        return out.result()
    caches = decoder.init_cache(len(prompts), max_len)
    logits, caches = decoder.prefill(decoder.state, jnp.asarray(tokens), jnp.asarray(lengths), caches)
    cur = jnp.asarray(lengths)
    while True:
        key, sub = jax.random.split(key)
        tok, lp = sample(logits, sub, temperature=float(temperature), top_p=float(top_p))
        out.add(np.asarray(tok)[:, None], np.asarray(lp)[:, None])
        if out.done.all():
            return out.result()
        logits, caches = decoder.decode(decoder.state, tok, cur, caches)
        cur = cur + 1


def prompt_batch(decoder: Decoder, prompts, max_new_tokens: int, pad_id: int, max_len: int | None, extra: int = 0):
    """Validated prompts -> (right-padded tokens [B,S] int32, lengths [B], the cache capacity: at least the longest
    prompt + max_new_tokens + extra slots a step may write past the last token)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    lengths = np.array([len(p) for p in prompts], np.int32)
    S = int(lengths.max())
    need = S + max_new_tokens + extra
    m = decoder.cache_multiple  # a mesh's context shards split the cache's slots
    max_len = -(-need // m) * m if max_len is None else max_len
    if max_len < need:
        raise ValueError(f"max_len={max_len} < longest prompt {S} + max_new_tokens {max_new_tokens}"
                         + (f" + speculative {extra}" if extra else ""))
    vocab = decoder.model.cfg.vocab_size
    tokens = np.full((len(prompts), S), pad_id, np.int32)
    for b, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab})")
        tokens[b, :len(p)] = p
    return tokens, lengths, max_len


class Output:
    """The generated tokens as they arrive: each row keeps its first tokens up to a stop token or max_new_tokens."""

    def __init__(self, B: int, max_new_tokens: int, stop_tokens, pad_id: int):
        self.tokens = np.full((B, max_new_tokens), pad_id, np.int32)
        self.logprobs = np.zeros((B, max_new_tokens), np.float32)
        self.lengths = np.zeros(B, np.int32)
        self.steps = np.full(B, -1, np.int32)  # the prefill's token is not a decode step
        self.done = np.zeros(B, bool)
        self.stops = np.asarray(list(stop_tokens), np.int32)

    def add(self, tokens, logprobs, counts=None):
        """tokens, logprobs [B,n] of one pass, the first counts[b] (default n) valid per row."""
        counts = np.full(len(tokens), tokens.shape[1]) if counts is None else counts
        for b in np.flatnonzero(~self.done):
            self.steps[b] += 1
            for j in range(int(counts[b])):
                i = self.lengths[b]
                self.tokens[b, i], self.logprobs[b, i] = tokens[b, j], logprobs[b, j]
                self.lengths[b] += 1
                if tokens[b, j] in self.stops or self.lengths[b] == self.tokens.shape[1]:
                    self.done[b] = True
                    break

    def result(self) -> Generation:
        return Generation(self.tokens, self.logprobs, self.lengths, self.steps)
