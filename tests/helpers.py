"""Shared test fixtures: the tiny model config (configs/tiny.py's) and batch builders."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.config import ModelConfig
from glmjax.model import Batch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `configs` from the repo root
from configs import tiny as tiny_config_file  # noqa: E402

# configs/tiny.py's model with the tests' delta: docs/model.md A.5's top-8 (the tests' sequences are short) and small
# query / loss chunks, so that blocking and chunking run over several blocks.
TINY = {**tiny_config_file.get_config().model.to_dict(), "index_topk": 8, "block_q": 16, "loss_chunk": 20}
TWO_LAYERS = dict(num_hidden_layers=2, indexer_types=("full", "shared"))  # a dense + an MoE layer
# Every kind of layer and parameter in two stacks instead of tiny()'s three (a dense-MLP full layer, then a MoE full
# layer and the shared layer after it, the MTP layer): compiles in about half of tiny()'s time
THREE_LAYERS = dict(num_hidden_layers=3, indexer_types=("full", "full", "shared"))


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**TINY, **kw})


def batch_from_docs(docs_per_row, seq_len):
    """Pack lists of token lists into one row each: segment ids from 1, positions restart per document."""
    B = len(docs_per_row)
    tok = np.zeros((B, seq_len), np.int32)
    seg = np.zeros((B, seq_len), np.int32)
    pos = np.zeros((B, seq_len), np.int32)
    for b, docs in enumerate(docs_per_row):
        i = 0
        for d, doc in enumerate(docs):
            n = len(doc)
            tok[b, i:i + n], seg[b, i:i + n], pos[b, i:i + n] = doc, d + 1, np.arange(n)
            i += n
    return Batch(jnp.asarray(tok), jnp.asarray(seg), jnp.asarray(pos))


def random_batch(cfg, B, S, seed=0):
    tok = jax.random.randint(jax.random.key(seed), (B, S), 0, cfg.vocab_size, dtype=jnp.int32)
    return Batch(tok, jnp.ones((B, S), jnp.int32), jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))


FAST = {"xla_backend_optimization_level": 0}  # XLA:CPU compiles ~1.6x faster: for programs a test runs once


def jit_once(fn):
    """fn(model, *args) jitted with the model's state as an argument and XLA:CPU's optimisations off (FAST): for
    compile-bound tests that call it once; the model is not updated in place."""
    from flax import nnx

    def call(model, *args):
        graphdef, state = nnx.split(model)
        return jax.jit(lambda s, *a: fn(nnx.merge(graphdef, s), *a), compiler_options=FAST)(state, *args)

    return call
