"""A model on the retrieval tasks (glmjax/eval/retrieval.py): accuracy per task x length (x depth) in dense and
sparse attention, and every indexer's needle recall (glmjax/eval/needles.py); the tables as a dict and as Markdown.

Prompts are bytes (the byte tokenizer: a prompt of L bytes is BOS + L tokens), test-pool answers, answered greedily
with the decoder of each attention mode (stopping at EOS or after the longest answer + 4 tokens) and scored by RULER's
string match. The prompts of one task x length are the same for every mode and every model evaluated with the same
seed.
"""
from __future__ import annotations

import jax
import numpy as np
from tqdm import tqdm

from glmjax.data.tokenizer import ByteTokenizer
from glmjax.eval.needles import index_topk, needle_recall
from glmjax.eval.retrieval import TASKS, examples, min_length, string_match_all
from glmjax.infer import Decoder, generate
from glmjax.model import GLM

MODES = ("dense", "sparse")


def check(tasks, lengths, depths, samples: int, modes) -> None:
    """One named error for the first bad argument."""
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"task {t!r}: must be one of {TASKS}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r}: must be one of {MODES}")
    for L in lengths:
        for t in tasks:
            if L < min_length(t):
                raise ValueError(f"length {L}: task {t!r} needs at least {min_length(t)} bytes")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth {d}: must be in [0, 1]")
    if samples < 1:
        raise ValueError(f"samples {samples}: must be >= 1")


def evaluate(model: GLM, tasks=TASKS, lengths=(1024, 2048, 4096), depths=(0.0, 0.25, 0.5, 0.75, 1.0),
             samples: int = 4, modes=MODES, seed: int = 0, batch_size: int = 8, progress: bool = True) -> dict:
    """-> {"accuracy": {mode: {task: {length: mean}}}, "by_depth": {mode: {task: {length: [per depth]}}},
    "needle_recall": {"layer i": {task: {length: mean}}}, and the arguments}. Lengths are keys as str (JSON)."""
    check(tasks, lengths, depths, samples, modes)
    tok = ByteTokenizer()
    decoders = {m: Decoder(model, m) for m in modes}
    full = model.cfg.full_layers
    out = {"tasks": list(tasks), "lengths": list(lengths), "depths": list(depths), "samples": samples,
           "modes": list(modes), "seed": seed, "index_topk": model.cfg.index_topk, "full_layers": full,
           "accuracy": {m: {t: {} for t in tasks} for m in modes},
           "by_depth": {m: {t: {} for t in tasks} for m in modes},
           "needle_recall": {f"layer {i}": {t: {} for t in tasks} for i in full}}
    bar = tqdm(total=len(tasks) * len(lengths), desc="retrieval", unit="cell", disable=not progress, dynamic_ncols=True)
    for t in tasks:
        for L in lengths:
            exs = examples(t, samples * len(depths), [L], depths, [seed, TASKS.index(t), L], "test")
            n, b = len(exs), min(batch_size, len(exs))
            rows = np.resize(np.arange(n), -(-n // b) * b)  # the last batch filled up with the first prompts
            ids = np.stack([tok.encode(exs[r].prompt, bos=True, eos=False) for r in rows])  # [rows, 1 + L]
            depth_of = np.asarray([e.depth for e in exs])
            new = max(len(e.response.encode()) for e in exs) + 4
            for m in modes:
                answers = []
                for i in range(0, len(rows), b):  # one shape: one compile per length and mode
                    g = generate(decoders[m], list(ids[i:i + b]), new, key=jax.random.key(0), stop_tokens=[tok.eos_id],
                                 pad_id=tok.pad_id)
                    answers += [g.tokens[j, :g.lengths[j]] for j in range(b)]
                scores = np.asarray([string_match_all(tok.decode(a[a < tok.vocab_size]), e.answers)
                                     for a, e in zip(answers, exs)])  # the first n: the padding rows dropped
                out["accuracy"][m][t][str(L)] = float(scores.mean())
                out["by_depth"][m][t][str(L)] = [float(scores[depth_of == d].mean()) for d in depths]
            if full:
                topk = np.concatenate([index_topk(model, ids[i:i + b]) for i in range(0, len(rows), b)], 1)[:, :n]
                spans = [[(s + 1, e + 1) for s, e in x.needles] for x in exs]  # token positions: after BOS
                recall = np.stack([needle_recall(topk[f], spans) for f in range(len(full))])  # [F, n]
                for f, layer in enumerate(full):
                    out["needle_recall"][f"layer {layer}"][t][str(L)] = float(np.nanmean(recall[f]))
            bar.set_postfix({m: f"{out['accuracy'][m][t][str(L)]:.2f}" for m in modes} | {"task": t, "len": L})
            bar.update()
    bar.close()
    return out


def markdown(result: dict, title: str = "") -> str:
    """One table: a row per mode x task (accuracy) and per indexer x task (needle recall), a column per length."""
    lengths = [str(L) for L in result["lengths"]]
    lines = ([f"**{title}**", ""] if title else []) + [
        "| | task | " + " | ".join(lengths) + " |", "|---|---|" + "---:|" * len(lengths)]
    for m, per_task in result["accuracy"].items():
        for t, row in per_task.items():
            lines.append(f"| {m} accuracy | {t} | " + " | ".join(f"{row[L]:.2f}" for L in lengths) + " |")
    for layer, per_task in result["needle_recall"].items():
        for t, row in per_task.items():
            lines.append(f"| needle recall, {layer} | {t} | " + " | ".join(f"{row[L]:.2f}" for L in lengths) + " |")
    return "\n".join(lines) + "\n"
