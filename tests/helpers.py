"""Shared test fixtures: the SPEC A.5 tiny config and batch builders."""
import jax
import jax.numpy as jnp
import numpy as np

from glmjax.config import ModelConfig
from glmjax.model import Batch

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
            first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, index_n_heads=4, index_head_dim=32, index_topk=8,
            indexer_types=("full", "full", "shared", "shared", "full", "shared"), rope_theta=10000.0,
            max_position_embeddings=256, mtp_depth=3, block_q=16, loss_chunk=20)


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
