"""PromptsTask (`ppo.task = "prompts"`): PPO on your own prompts, read from a JSONL file.

    ppo.task_args = dict(path="prompts.jsonl", fields=("answer",))

Each line is a JSON object with either `messages` (a conversation, as in chat SFT data: role in system / developer /
user / assistant / tool, content; optional `tools`) or `prompt` (a string: one user message), plus whatever the
reward needs (e.g. `answer`, unit tests); `fields` names the ones every row must have. The reward sees the decoded
response and a Problem whose `row` is the whole JSON object (`problem.row["answer"]`), `answer` its answer field as
text (or ""), `where` "file:line". Rows are held out for evaluation by the hash of their prompt (Task.is_heldout).
Any bad row stops the run at start with a DataError naming the file and the line.
"""
from __future__ import annotations

import json

import numpy as np

from glmjax.config import ConfigError
from glmjax.data.chat import conversation
from glmjax.data.sources import DataError, Skip
from glmjax.rl.tasks import DEMO_TASKS, Problem, Task


def read_prompts(path: str, fields=()) -> list[Problem]:
    """The rows of a prompts JSONL file -> Problems, in file order (blank lines skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"prompts file {path!r} cannot be read ({type(e).__name__}: {e})") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise DataError(f"{where}: a JSON {type(row).__name__}, not an object")
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(f"{where}: missing field {missing[0]!r} (ppo.task_args.fields={list(fields)})")
        if ("messages" in row) == ("prompt" in row):
            raise DataError(f"{where}: needs exactly one of 'messages' (a conversation) or 'prompt' (a string)")
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise DataError(f"{where}: field 'prompt' must be a non-empty string")
            prompt = row["prompt"]
        else:
            chat = conversation(row, "messages", "tools")
            if isinstance(chat, Skip):
                raise DataError(f"{where}: {chat.detail}")
            row = {**row, "messages": chat.messages, "tools": chat.tools}
            prompt = json.dumps(chat.messages, sort_keys=True, ensure_ascii=False)
        answer = row.get("answer", "")
        out.append(Problem(prompt, answer if isinstance(answer, str) else json.dumps(answer), row, where))
    if not out:
        raise DataError(f"prompts file {path!r} has no rows")
    return out


class PromptsTask(Task):
    name = "prompts"

    def __init__(self, path: str | None = None, fields=(), heldout_fraction: float = 0.2):
        super().__init__(heldout_fraction)
        if not isinstance(path, str):
            raise DataError(f"ppo.task_args.path={path!r}: the prompts JSONL file (task 'prompts')")
        self.path, self.rows = path, read_prompts(path, tuple(fields))
        self.splits = {h: [p for p in self.rows if self.is_heldout(p) == h] for h in (False, True)}
        for h, rows in self.splits.items():
            if not rows:
                raise DataError(f"prompts file {path!r}: no {'held-out' if h else 'training'} row among "
                                f"{len(self.rows)} (ppo.heldout_fraction={heldout_fraction}: add rows or change it)")

    def check_prompts(self, text, tokenizer: str, max_prompt_len: int) -> None:
        """Every row renders with `text` (glmjax/rl/text.py, ppo.tokenizer's rule) to at most max_prompt_len tokens."""
        if text.template is None and any("messages" in r.row for r in self.rows):
            raise ConfigError(f"ppo.tokenizer={tokenizer!r}: rows with 'messages' ({self.path}) need a "
                              "tokenizer with a chat template ('hf:DIR')")
        for r in self.rows:
            try:
                n = len(text.prompt(r))
            except DataError as e:  # the template's raise_exception, a variable it lacks, ...
                raise DataError(f"{r.where}: {e}") from e
            if n > max_prompt_len:
                raise ConfigError(f"{r.where}: the prompt is {n} tokens, more than ppo.max_prompt_len={max_prompt_len}")

    def sample(self, rng: np.random.Generator, heldout: bool = False) -> Problem:
        rows = self.splits[heldout]
        return rows[rng.integers(len(rows))]

    def eval_set(self, n: int, seed: int = 1234) -> list[Problem]:
        """The first n held-out rows, in file order."""
        return self.splits[True][:n]


TASKS: dict[str, type[Task]] = {**DEMO_TASKS, "prompts": PromptsTask}  # every ppo.task
