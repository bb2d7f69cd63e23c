"""Long-context retrieval tasks, generated as bytes: RULER's synthetic families (NVIDIA RULER,
scripts/data/synthetic/) without downloads.

  passkey        landmark attention's prompt: the grass / sky filler, "The pass key is K. Remember it. K is the pass
                 key." somewhere in it, then "What is the pass key? The pass key is" (K: 5 digits)
  niah_single    RULER's needle in a haystack: "One of the special magic numbers for KEY is: VALUE." in the repeated
                 filler (RULER's "repeat" haystack), asked for KEY (VALUE: 7 digits, KEY: a made-up word)
  niah_multikey  the same with 3 more needles of other keys at random depths (distractors)
  vt             variable tracking: a chain "VAR A = 12345." "VAR B = VAR A." ... (4 hops) spread over the filler;
                 the answer is every variable that holds the value

A prompt is exactly `length` bytes (= tokens for the byte tokenizer, before its BOS): header, filler with the needles
at sentence boundaries, the question and RULER's answer prefix, which the model continues with the answer. The
needle (for vt the first statement of the chain) starts at `depth` of the filler (0: first, 1: last). Every example
records the byte spans of its needle statements (what the indexer's top-k must find: `glmjax.eval.needles`).

Train and test answers come from disjoint pools (a checksum of the answer string picks its pool), so no test answer
occurs in any training example, whatever the seeds. Scoring is RULER's string match: the share of the reference
answers found in the prediction, case-insensitive (`string_match_all`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import zlib

import numpy as np

TASKS = ("passkey", "niah_single", "niah_multikey", "vt")
VERSION = 1  # of the generated text: part of training_file's name (raise it when a template or a draw changes)
SPLITS = ("train", "test")
TEST_SHARE = 8  # one answer string in 8 belongs to the test pool

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.\n")
NIAH_HEADER = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_HOPS = 4
MULTIKEY_DISTRACTORS = 3


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt. prompt: `length` bytes, ending in the answer prefix; response: the answer as training text (a
    leading space, the answer, a full stop); answers: RULER's references; needles: [start, end) byte offsets in
    prompt of each statement the answer needs (not niah_multikey's distractors)."""
    task: str
    prompt: str
    response: str
    answers: tuple[str, ...]
    needles: tuple[tuple[int, int], ...]
    length: int
    depth: float


def in_pool(answer: str, split: str) -> bool:
    return (zlib.crc32(answer.encode()) % TEST_SHARE == 0) == (split == "test")


def draw(rng: np.random.Generator, make, split: str, exclude=()) -> str:
    """A string from make(rng) in the split's pool and not in `exclude` (rejection: 1 in 8 or 7 in 8 accepted)."""
    for _ in range(10_000):
        s = make(rng)
        if in_pool(s, split) and s not in exclude:
            return s
    raise RuntimeError("no string of the pool after 10,000 draws")


def digits(n: int):
    return lambda rng: str(int(rng.integers(10 ** (n - 1), 10 ** n)))


def word(rng: np.random.Generator) -> str:
    """A made-up lowercase word of 3 syllables (RULER draws dictionary words; no download here)."""
    return "".join(rng.choice(list("bdfgklmnprstvz")) + rng.choice(list("aeiou")) for _ in range(3))


def var_name(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5))


def task_parts(task: str, rng: np.random.Generator, split: str):
    """-> (header, [(statement, depth or None)], question, response, answers); depth None: at the example's depth
    for the first statement; vt's later statements and multikey's distractors get theirs here."""
    if task == "passkey":
        k = draw(rng, digits(5), split)
        return (PASSKEY_HEADER, [f"The pass key is {k}. Remember it. {k} is the pass key. "],
                "\nWhat is the pass key? The pass key is", f" {k}.", (k,))
    if task in ("niah_single", "niah_multikey"):
        keys = [draw(rng, word, split)]
        for _ in range(MULTIKEY_DISTRACTORS if task == "niah_multikey" else 0):
            keys.append(draw(rng, word, "train", exclude=keys))  # distractors: never asked
        values = [draw(rng, digits(7), split)] + [draw(rng, digits(7), "train") for _ in keys[1:]]
        needles = [f"One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
        question = (f"\nWhat are all the special magic numbers for {keys[0]} mentioned in the provided text? "
                    f"The special magic numbers for {keys[0]} mentioned in the provided text are")
        return NIAH_HEADER, needles, question, f" {values[0]}.", (values[0],)
    if task == "vt":
        names = []
        for _ in range(VT_HOPS + 1):
            names.append(draw(rng, var_name, split, exclude=names))
        value = digits(5)(rng)
        needles = [f"VAR {names[0]} = {value}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
        question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
                    f"According to the chain(s) of variable assignment in the text above, {len(names)} variables "
                    f"are assigned the value {value}, they are:")
        return VT_HEADER, needles, question, " " + ", ".join(names) + ".", tuple(names)
    raise ValueError(f"task {task!r}: must be one of {TASKS}")


def min_length(task: str) -> int:
    """The shortest prompt of `task` in bytes: header, needles and question with no filler (+ a margin for longer
    draws)."""
    header, needles, question, _, _ = task_parts(task, np.random.default_rng(0), "train")
    return len(header) + sum(len(n) for n in needles) + len(question) + 8


def make_example(task: str, length: int, depth: float, rng: np.random.Generator, split: str = "train") -> Example:
    """One example of `task`, exactly `length` bytes of prompt, the (first) needle at `depth` in [0, 1] of the
    filler. The answer comes from the split's pool."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: must be one of {TASKS}")
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: must be one of {SPLITS}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth}: must be in [0, 1]")
    header, needles, question, response, answers = task_parts(task, rng, split)
    room = length - len(header) - sum(len(n) for n in needles) - len(question)
    if room < 0:
        raise ValueError(f"length {length}: task {task!r} needs at least {min_length(task)} bytes")
    filler = (FILLER * (room // len(FILLER) + 1))[:room]
    cuts = [0] + [i + 2 for i in range(len(filler) - 1) if filler[i:i + 2] == ". "]  # sentence starts
    if task == "vt":  # the chain in order from depth on, evenly spread over the rest of the filler
        depths = [depth + (1.0 - depth) * i / len(needles) for i in range(len(needles))]
    else:
        depths = [depth] + [float(d) for d in rng.uniform(0.0, 1.0, len(needles) - 1)]
    at = [cuts[int(round(d * (len(cuts) - 1)))] for d in depths]
    order = sorted(range(len(needles)), key=lambda i: (at[i], i))
    text, spans, last = header, [None] * len(needles), 0
    for i in order:
        text += filler[last:at[i]]
        spans[i] = (len(text.encode()), len(text.encode()) + len(needles[i].encode()))
        text += needles[i]
        last = at[i]
    prompt = text + filler[last:] + question
    assert len(prompt.encode()) == length, (len(prompt.encode()), length)
    needed = 1 if task == "niah_multikey" else len(spans)  # the distractors are not needles
    return Example(task, prompt, response, answers, tuple(spans[:needed]), length, depth)


def examples(task: str, n: int, lengths, depths, seed, split: str = "train") -> list[Example]:
    """n examples, the i-th of lengths[i % len(lengths)] bytes at depths[(i // len(lengths)) % len(depths)] (a grid
    swept in order); the strings from `seed` (an int or a sequence of ints, as numpy's default_rng takes)."""
    rng = np.random.default_rng(seed)
    return [make_example(task, int(lengths[i % len(lengths)]), float(depths[(i // len(lengths)) % len(depths)]),
                         rng, split) for i in range(n)]


def string_match_all(prediction: str, answers) -> float:
    """RULER's score of one prediction: the share of references it contains (case-insensitive)."""
    pred = prediction.lower()
    return float(np.mean([a.lower() in pred for a in answers]))


def write_jsonl(path: str, tasks, n: int, lengths: tuple[int, int], seed: int, split: str = "train",
                fields: str = "text") -> int:
    """n training documents, tasks in turn, each of a length drawn uniformly from `lengths` (inclusive; raised to
    the task's minimum) with its needle at a uniform depth, as JSONL: fields "text" (prompt + response: an LM
    document) or "prompt_response" (SFT pairs, the loss on the answer only). -> bytes of the longest document."""
    if fields not in ("text", "prompt_response"):
        raise ValueError(f"fields {fields!r}: must be 'text' or 'prompt_response'")
    rng = np.random.default_rng(seed)
    longest = 0
    with open(path, "w") as f:
        for i in range(n):
            task = tasks[i % len(tasks)]
            length = int(rng.integers(max(min_length(task), lengths[0]), max(min_length(task), lengths[1]) + 1))
            e = make_example(task, length, float(rng.uniform()), rng, split)
            row = {"text": e.prompt + e.response} if fields == "text" else {"prompt": e.prompt, "response": e.response}
            f.write(json.dumps(row) + "\n")
            longest = max(longest, len((e.prompt + e.response).encode()))
    return longest


def training_file(tasks, n: int, lengths: tuple[int, int], seed: int, fields: str = "text",
                  directory: str | None = None) -> str:
    """The path of `write_jsonl`'s file for these arguments, written on first use (whole or not at all) into
    `directory` (default $GLMJAX_DATA_DIR, else ~/.cache/glmjax/data): configs name generated data by what it is."""
    directory = directory or os.environ.get("GLMJAX_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "glmjax", "data")
    name = f"retrieval-v{VERSION}_{'+'.join(tasks)}_{n}_{lengths[0]}-{lengths[1]}_seed{seed}_{fields}.jsonl"
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.{os.getpid()}.partial"
        write_jsonl(partial, tasks, n, lengths, seed, "train", fields)
        os.replace(partial, path)
    return path
