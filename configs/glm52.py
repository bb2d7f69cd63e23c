"""GLM-5.2 = GLM-5 + IndexShare (docs/model.md A.2): every 4th layer from layer 3 keeps its own indexer, giving 21
"full" layers {0, 1, 2, 6, 10, ..., 74}; the 57 others reuse the previous full layer's top-k. RoPE theta 8e6,
1M context. Same tensor geometry as GLM-5 (shared layers carry no indexer weights)."""
from configs import glm5


def get_config():
    c = glm5.get_config()
    c.model.index_topk_freq = 4
    c.model.index_skip_topk_offset = 3
    c.model.rope_theta = 8e6
    c.model.max_position_embeddings = 1048576
    return c
