"""Prefill and token-by-token decode against the MLA compressed cache (docs/model.md D), on one device or a mesh.

Per layer and token the cache holds the 576-d latent row [c_kv (normed, 512) | k_pe (roped, 64)]; full layers
also hold the indexer key (d_I). IndexShare "shared" layers keep no indexer cache. Attention against the cache
uses absorbed weights (docs/model.md D.2); sparse mode gathers only the top-k latent rows, chosen by the same exact,
lowest-index-tie-breaking top-k as training.

Rows of a batch may have different lengths: sequence b occupies cache slots [0, length[b]); a step writes its S new
tokens at slots start[b] .. start[b]+S-1 (RoPE position = slot) and every slot >= the new length is invisible.

On a mesh (`Decoder(model, mode, mesh)`) the state is placed by the logical-axis rules, the caches [n,B,T,C] are
split over the batch axes (B) and `context` (T, contiguous: shard i holds slots i*T/N .. (i+1)*T/N-1; the cache
has no heads axis, so tensor ranks hold the same rows), and with N = context > 1:
- prefill / extend (S new tokens, padded to a multiple of the layout's pieces): the tokens go in the model's
  context layout (zig-zag: shard i takes chunks i and 2N-1-i of 2N), each shard runs the per-token layers on its
  S/N tokens and every attention with its local queries at their natural slots (glmjax/model/context.py): the
  new latent rows / indexer keys are all-gathered and each shard writes those of its slot range into its piece of
  the cache (`write_on_context`), then the cache rows are all-gathered for the attention (the training forward's
  gather of latent rows, over the cache's T). Per layer, [B,T,576 (+ d_I)] crosses devices, not per-head K/V.
- decode (one token per row): the query is replicated over context and XLA's partitioner splits the attention
  over the cache's T: each shard scores its T/N rows (dense: materialised [B,H,1,T/N] scores, a partial softmax
  whose max / sum / weighted latent sum are all-reduced over context; sparse: the indexer scores of its rows, a
  top-k of the [B,1,T] scores and the gather of the k selected rows), and the new row is written by the shard that
  owns its slot. The cache itself
  never crosses devices; per layer a decode step moves O(B·(T + k·576 + H·576)) values.
Pallas kernels run inside shard_map (glmjax/model/backends.py); on a context-split cache each shard runs them over
its own T/N rows: the indexer top-k per shard, then the exact top-k of the N x k candidates; the sparse attention
over the selected rows each shard holds, its outputs combined by their log-sum-exps (flash-decoding). Dense decode
with attention_impl="pallas" is the XLA path above (there is no dense Pallas kernel over an absorbed cache).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glmjax.model import GLM, context
from glmjax.model.layers import dtype_of, rope_tables
from glmjax.model.mla import Ctx
from glmjax.parallel.rules import logical_spec
from glmjax.parallel.sharding import state_shardings, with_mesh

CACHE_AXES = ("layers", "batch", "sequence", None)  # [n_units, B, T, C]: T split like a sequence (over context)


def init_cache(model: GLM, batch_size: int, max_len: int):
    """Zero cache: per stack, per position in its unit, {"latent": [n_units, B, T, r_kv+d_r], "index_k": [..., d_I]}
    (index_k on full layers only)."""
    cfg = model.cfg
    dt = dtype_of(cfg.dtype)
    caches = []
    for plan in model.plans:
        n = len(plan.starts)
        per_pos = []
        for _, has_indexer in plan.kinds:
            c = {"latent": jnp.zeros((n, batch_size, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dt)}
            if has_indexer:
                c["index_k"] = jnp.zeros((n, batch_size, max_len, cfg.index_head_dim), dt)
            per_pos.append(c)
        caches.append(per_pos)
    return caches


def forward_cached(model: GLM, tokens, start, caches, mode: str):
    """tokens [B,S] written at slots start[b]+s -> (post-norm hidden [B,S,D], caches). The caller's lengths after
    this step are start + S (prefill of right-padded prompts passes S = max length and masks by `lengths` later).
    On a mesh whose context axis has N > 1 devices (the abstract mesh in context) S must be 1 (decode) or a
    multiple of the context layout's pieces (module doc)."""
    B, S = tokens.shape
    T = caches[0][0]["latent"].shape[2]
    n = context.context_size()
    layout = None if n == 1 or S == 1 else context.layout(model.cfg.context_layout, S)
    slots = start[:, None] + (jnp.arange(S, dtype=jnp.int32)[None] if layout is None else layout.slots((B, S)))
    if layout is not None:  # each context shard takes its S/N tokens of every row
        tokens = constrain(layout.to_layout(tokens), ("batch", "sequence"))
    ctx = cache_ctx(model.cfg, start, slots, T, mode,
                    layout=None if layout is None else context.Layout("contiguous", n),
                    cache_write=None if n == 1 else write_on_context)
    h, _, caches = model.trunk(tokens, ctx, caches)
    return (h if layout is None else layout.to_natural(h)), caches


def cache_ctx(cfg, start, slots, T: int, mode: str, **kw) -> Ctx:
    """The Ctx of a forward against a cache of T slots: this step's S new rows at slots [B,S] (start[b] ..
    start[b]+S-1 in any order; RoPE position = slot), every slot from start + S on invisible."""
    B, S = slots.shape
    cos, sin = rope_tables(slots, cfg)
    kv_valid = (jnp.arange(T)[None, :] < (start + S)[:, None]).astype(jnp.int32)
    return Ctx(cos, sin, jnp.ones((B, S), jnp.int32), mode, q_idx=slots, kv_valid=kv_valid, **kw)


def constrain(x, axes):
    """x held as the logical axes say on the mesh in context (a no-op without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(axes, x.shape, mesh)))


def write_on_context(cache, rows, q_idx):
    """cache [B,T,C] split over context (shard i: slots i*T/N ..) with rows [B,S,C] written at slots q_idx [B,S]
    (each row's slots: start .. start+S-1 in any order, e.g. the context layout's): every shard receives all the new
    rows (prefill: an all-gather of [B,S,C]; decode: the row is already there) and rewrites, in place, the window of
    min(S, T/N) slots of its piece that holds every new slot in its range. No cache row crosses devices."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = logical_spec(CACHE_AXES[1:], cache.shape, mesh)
    rows_spec = P(spec[0])

    def body(c, r, idx):
        L, S = c.shape[1], r.shape[1]
        W = min(S, L)
        off = 0 if spec[1] is None else jax.lax.axis_index(spec[1]) * L  # this shard's first slot

        def one(c, r, idx):  # one row: c [L,C], r [S,C], idx [S]
            start = jnp.min(idx)
            p0 = jnp.clip(start - off, 0, L - W)  # the window [p0, p0+W) of local slots
            rank = off + p0 + jnp.arange(W) - start  # the new row (by slot order) each window slot takes
            new = r[jnp.argsort(idx)[jnp.clip(rank, 0, S - 1)]]
            keep = jax.lax.dynamic_slice_in_dim(c, p0, W, 0)
            ok = ((rank >= 0) & (rank < S))[:, None]
            return jax.lax.dynamic_update_slice_in_dim(c, jnp.where(ok, new.astype(c.dtype), keep), p0, 0)

        return jax.vmap(one)(c, r, idx)

    return jax.shard_map(body, in_specs=(spec, rows_spec, rows_spec), out_specs=spec, check_vma=False)(
        cache, rows, q_idx)


class Decoder:
    """Jitted prefill / decode steps for one model; caches are donated, shapes are fixed per (batch, capacity),
    so generating a token never recompiles. mesh: run on that device mesh (module doc): the state is placed by
    the logical-axis rules, `init_cache` creates the caches split over the batch axes and context, and every step
    is traced with the mesh in context. compiler_options: passed to jax.jit (e.g. tests' FAST)."""

    def __init__(self, model: GLM, mode: str = "sparse", mesh: jax.sharding.Mesh | None = None,
                 compiler_options: dict | None = None):
        if mode not in ("dense", "sparse"):
            raise ValueError(f"mode={mode!r}: must be 'dense' or 'sparse'")
        self.model, self.mode, self.mesh, self.compiler_options = model, mode, mesh, compiler_options
        self.speculators = {}  # depth -> its SpeculativeDecoder (glmjax/infer/generate.py `speculator`)
        self.graphdef, self.state = nnx.split(model)
        self.context = 1 if mesh is None else context.context_size(mesh)
        wrap = (lambda f: f) if mesh is None else functools.partial(with_mesh, mesh=mesh)
        if mesh is not None:
            self.state = jax.device_put(self.state, state_shardings(self.state, mesh))
        jit = functools.partial(jax.jit, donate_argnums=(3,), compiler_options=compiler_options)
        self.prefill = jit(wrap(self._prefill))
        self.decode = jit(wrap(self._decode))
        self.extend = jit(wrap(self._extend))

    @property
    def cache_multiple(self) -> int:
        """The cache capacity (max_len) must be a multiple of this: the context shards that split it."""
        return self.context

    def init_cache(self, batch_size: int, max_len: int):
        """`init_cache`; on a mesh created directly in its sharding (`cache_sharding`)."""
        if self.mesh is None:
            return init_cache(self.model, batch_size, max_len)
        if max_len < 1 or max_len % self.context:
            raise ValueError(f"max_len={max_len}: the cache's slots are split over the {self.context} context shards "
                             f"of mesh {dict(self.mesh.shape)}, so it must be a positive multiple of {self.context}")
        shapes = jax.eval_shape(lambda: init_cache(self.model, batch_size, max_len))
        return jax.jit(lambda: init_cache(self.model, batch_size, max_len),
                       out_shardings=jax.tree.map(lambda s: self.cache_sharding(s.shape), shapes))()

    def cache_sharding(self, shape) -> NamedSharding:
        """[n_units, B, T, C] cache leaf -> B over the batch axes (where they divide it), T over context."""
        return NamedSharding(self.mesh, logical_spec(CACHE_AXES, shape, self.mesh))

    def _padded(self, tokens):
        """tokens [B,S] right-padded to a multiple of the context layout's pieces (module doc; not on one context
        shard, nor for S = 1).
        The pad rows land at slots past the step's length (invisible to its tokens, overwritten by the next step;
        past the capacity, dropped)."""
        pieces = self.context * (2 if self.model.cfg.context_layout == "zigzag" else 1)
        pad = 0 if self.context == 1 or tokens.shape[1] == 1 else -tokens.shape[1] % pieces  # S = 1: decode
        return jnp.pad(tokens, ((0, 0), (0, pad))) if pad else tokens

    def _forward(self, state, tokens, start, caches):
        model = nnx.merge(self.graphdef, state)
        S = tokens.shape[1]
        h, caches = forward_cached(model, self._padded(tokens), start, caches, self.mode)
        if self.mesh is not None:  # the caches stay in their sharding
            caches = jax.tree.map(lambda c: jax.lax.with_sharding_constraint(c, self.cache_sharding(c.shape)), caches)
        return model, h[:, :S], caches

    def _prefill(self, state, tokens, lengths, caches):
        """Right-padded prompts tokens [B,S], lengths [B] -> logits of each row's last prompt token [B,V], caches."""
        model, h, caches = self._forward(state, tokens, jnp.zeros_like(lengths), caches)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return model.logits(last), caches

    def _extend(self, state, tokens, start, caches):
        """Chunked prefill: tokens [B,S] appended at slots start[b].. -> logits of each row's last new token, caches.
        A long prompt goes in as several chunks, so attention temporaries stay [B, H, chunk, T]."""
        model, h, caches = self._forward(state, tokens, start, caches)
        return model.logits(h[:, -1]), caches

    def _decode(self, state, tokens, lengths, caches):
        """One new token per row, tokens [B] at slot lengths[b] -> logits [B,V] f32, caches."""
        model, h, caches = self._forward(state, tokens[:, None], lengths, caches)
        return model.logits(h[:, 0]), caches


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits, key, temperature: float, top_p: float):
    """logits [B,V] f32 -> (tokens [B] int32, log-probs [B] f32).

    temperature 0 = greedy. The log-prob is that of the temperature-scaled, untruncated distribution
    log softmax(logits / T) -- what an RL trainer recomputes; top-p only restricts which tokens may be drawn.
    """
    if temperature == 0:
        tok = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        masked = logp
        if top_p < 1.0:
            order = jnp.argsort(-logp, axis=-1)
            p_sorted = jnp.exp(jnp.take_along_axis(logp, order, axis=-1))
            keep_sorted = (jnp.cumsum(p_sorted, axis=-1) - p_sorted) < top_p  # always keeps the most likely
            keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logp.shape[0])[:, None], order].set(keep_sorted)
            masked = jnp.where(keep, logp, -jnp.inf)
        tok = jax.random.categorical(key, masked, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
