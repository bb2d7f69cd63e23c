"""Tokenizer and data-pipeline throughput (tokens/s) next to the tiny model's train-step tokens/s, on CPU.

    python bench/tokenizer_throughput.py [--docs 2000] [--batches 200] [--steps 30]

Rows (all with the byte-level BPE of tests/hf_tokenizer_fixture.py, 500 tokens, trained on the embedded corpus):
  encode_batch      HFTokenizer.encode_batch on the first --docs stdlib files (the Rust library's threads)
  pipeline: text    make_pipeline over the embedded corpus, data.tokenizer="hf:DIR", seq 128 x batch 8, --batches
                    batches (prefetch off: the pipeline's own thread), shuffle windows of 64K tokens
  pipeline: chat    make_pipeline over a chat JSONL (rendered by the chat template, assistant mask), same shapes
  train step        configs/tiny.py (docs/model.md A.5, seq 128 x batch 8) on that tokenizer's text, --steps steps
                    after the first (compiling) one: the rate the pipeline has to keep up with
The pipeline never starves the step when its tokens/s exceed the train step's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from hf_tokenizer_fixture import corpus_lines, write_tokenizer  # noqa: E402

from glmjax.data import default_data_config, make_pipeline  # noqa: E402
from glmjax.data.hf_tokenizer import HFTokenizer  # noqa: E402
from glmjax.data.sources import stdlib_files  # noqa: E402

S, B = 128, 8


def encode_rate(tok: HFTokenizer, n_docs: int) -> float:
    root, names = stdlib_files()
    texts = []
    for name in names[:n_docs]:
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    t = time.perf_counter()
    n = sum(len(ids) for ids in tok.encode_batch(texts))
    return n / (time.perf_counter() - t)


def pipeline_rate(data, batches: int) -> float:
    """Non-padding tokens per second over `batches` batches, start-up included (small shuffle windows, so the
    timed batches are tokenized, not only packed)."""
    t, n = time.perf_counter(), 0
    it = iter(make_pipeline(data, S, B, seed=0))
    for _ in range(batches):
        n += int((next(it)["segment_ids"] > 0).sum())
    return n / (time.perf_counter() - t)


def chat_file(path: str, n: int = 4000) -> str:
    lines = corpus_lines()
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": lines[i % len(lines)]},
                    {"role": "assistant", "content": lines[(7 * i + 3) % len(lines)]}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def train_rate(tok_dir: str, steps: int, workdir: str) -> float:
    from configs import tiny
    from glmjax.train import run

    c = tiny.get_config()
    c.data.tokenizer = "hf:" + tok_dir
    c.train.update(steps=steps + 1, log_every=1, eval_every=0, eval_batches=0, checkpoint_every=steps + 1,
                   tensorboard=False)
    c.optim.warmup_steps = 1
    return run(c, workdir, progress=False)["tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok_dir = write_tokenizer(os.path.join(d, "tok"), vocab_size=500)
        tok = HFTokenizer(tok_dir)
        common = dict(tokenizer="hf:" + tok_dir, eval_fraction=0.0, prefetch=0, shuffle_window_tokens=1 << 16)
        rows = [("encode_batch", encode_rate(tok, args.docs)),
                ("pipeline: text", pipeline_rate(default_data_config(**common), args.batches)),
                ("pipeline: chat", pipeline_rate(default_data_config(
                    path=chat_file(os.path.join(d, "chat.jsonl")), messages_field="messages", **common),
                    args.batches)),
                ("train step (configs/tiny.py)", train_rate(tok_dir, args.steps, os.path.join(d, "run")))]
    print(f"| what | tokens/s |  (load average {os.getloadavg()[0]:.1f})\n|---|---:|")
    for name, rate in rows:
        print(f"| {name} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
