"""Layer-by-layer top-k overlap of a trained model: the picture that motivates IndexShare (docs/model.md B.8, E.4).

For held-out batches, every layer's dense attention picks its own top-k keys per query (the k keys with the
largest head-mean probability) and every layer with an indexer picks the indexer's top-k. The heatmaps show
overlap[i, j] = |top-k_i ∩ top-k_j| / k averaged over queries: neighbouring layers that select nearly the same
keys can share one indexer. A third panel shows each indexer's recall of its own layer's attention top-k.

  python -m glmjax.tools.topk_overlap --checkpoint runs/recipe_tiny/sparse_adapt --out overlap.png

--checkpoint: a stage workdir (newest readable checkpoint), an imported checkpoint, or a Hugging Face directory.
Writes the PNG and the matrices as JSON next to it.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax import resolve
from glmjax.data import default_data_config, make_pipeline
from glmjax.model import GLM
from glmjax.train.loop import to_batch
from glmjax.train.step import topk_overlap


def load_model(path: str) -> GLM:
    model, loaded = resolve.load_model(path, "--checkpoint")
    print(f"{path}: {loaded.where}")
    return model


def overlap_matrices(model: GLM, batches) -> dict:
    """-> {"attention": [L, L], "indexer": [F, F], "recall": [F], "full_layers": [F]} averaged over batches."""
    full = model.cfg.full_layers

    @nnx.jit
    def one(model, batch):
        _, aux = model(batch, "dense", topk_stats=True)
        a, x = aux.attn_topk, aux.index_topk
        pair = jax.vmap(jax.vmap(topk_overlap, (None, 0)), (0, None))
        return pair(a, a), pair(x, x), jax.vmap(topk_overlap)(x, a[jnp.asarray(full)])

    outs = [jax.device_get(one(model, to_batch(b))) for b in batches]
    attn, index, recall = (np.mean([o[i] for o in outs], axis=0) for i in range(3))
    return {"attention": attn.tolist(), "indexer": index.tolist(), "recall": recall.tolist(), "full_layers": full}


def plot(m: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = m["full_layers"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    for ax, key, ticks, name in ((axes[0], "attention", None, "main attention top-k (every layer)"),
                                 (axes[1], "indexer", full, "indexer top-k (layers with an indexer)")):
        a = np.asarray(m[key])
        im = ax.imshow(a, vmin=0, vmax=1, cmap="viridis")
        n = a.shape[0]
        labels = ticks if ticks is not None else list(range(n))
        ax.set_xticks(range(n), labels, fontsize=7)
        ax.set_yticks(range(n), labels, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
        ax.set_title(name, fontsize=10)
        if n <= 12:
            for i in range(n):
                for j in range(n):
                    ax.text(j, i, f"{a[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if a[i, j] < 0.6 else "black")
    fig.colorbar(im, ax=axes[1], fraction=0.046, pad=0.04, label="top-k overlap")
    axes[2].bar(range(len(full)), m["recall"], color="tab:orange")
    axes[2].set_xticks(range(len(full)), full, fontsize=7)
    axes[2].set_ylim(0, 1)
    axes[2].set_xlabel("layer")
    axes[2].set_title("indexer recall of its layer's attention top-k", fontsize=10)
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", default="topk_overlap.png")
    ap.add_argument("--data", default=None, help="data path (default: the embedded stdlib corpus, held-out split)")
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=2)
    args = ap.parse_args(argv)
    model = load_model(args.checkpoint)
    if args.seq_len <= model.cfg.index_topk:
        print(f"warning: seq_len {args.seq_len} <= index_topk {model.cfg.index_topk}: every query keeps every key, "
              "the overlaps are trivially 1")
    data = make_pipeline(default_data_config(path=args.data), args.seq_len, args.batch_size, 0, "eval")
    m = overlap_matrices(model, data.take(args.batches))
    m["k"], m["seq_len"], m["checkpoint"] = model.cfg.index_topk, args.seq_len, args.checkpoint
    plot(m, f"{args.checkpoint}: top-k overlap (k={model.cfg.index_topk}, seq {args.seq_len})", args.out)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(m, f, indent=1)
    adj = np.diag(np.asarray(m["attention"]), 1)
    print(f"wrote {args.out}: adjacent-layer attention top-k overlap mean {adj.mean():.3f} "
          f"(min {adj.min():.3f}); indexer recall mean {np.mean(m['recall']):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
