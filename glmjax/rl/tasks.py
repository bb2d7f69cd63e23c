"""Verifiable tasks: problems with a checkable answer, a deterministic held-out split, demonstrations for the
supervised warm-up, and reward functions selected by name (or "module:function") in the config.

With the byte rule (glmjax/rl/text.py) a prompt is BOS + "<question>=", a single-turn response is "<answer>" + EOS.
Your own prompts file is the task "prompts" (prompts.py). Tasks:
  arithmetic   "a+b=" -> "a+b" evaluated; operands in [low, high], operator pattern `ops` ("+" -> a+b, "*+" -> a*b+c),
               optionally only problems whose result is at most `max_result` (e.g. 9: single-digit answers)
  reverse      "rev:abca=" -> "acba"
  sort         "sort:3142=" -> "1234"
The multi-turn tool environment (env.py) poses arithmetic problems and offers a calculator.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import zlib
from typing import Callable

import numpy as np

from glmjax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str  # question text, without BOS (e.g. "3+4="); a prompts-dataset row: its prompt or its messages as JSON
    answer: str  # the verifiable answer (e.g. "7"); a prompts-dataset row: its "answer" field as text, or ""
    row: dict | None = dataclasses.field(default=None, compare=False)  # a prompts-dataset row (glmjax/rl/prompts.py)
    where: str = ""  # "file:line" of a dataset row, for error messages

    @property
    def messages(self) -> list[dict]:
        """The conversation the policy continues: the row's messages, else the prompt as one user message."""
        if self.row is not None and "messages" in self.row:
            return self.row["messages"]
        return [{"role": "user", "content": self.prompt}]


class Task:
    """A distribution of problems with a held-out split: a problem is held out iff crc32(prompt) falls in the lowest
    `heldout_fraction` of the hash range, so the split is the same in every process and run."""

    name = "task"

    def __init__(self, heldout_fraction: float = 0.2):
        self.heldout_fraction = heldout_fraction

    def random_problem(self, rng: np.random.Generator) -> Problem:
        raise NotImplementedError

    def is_heldout(self, p: Problem) -> bool:
        return zlib.crc32(p.prompt.encode()) % 10_000 < self.heldout_fraction * 10_000

    def sample(self, rng: np.random.Generator, heldout: bool = False) -> Problem:
        for _ in range(10_000):
            p = self.random_problem(rng)
            if self.is_heldout(p) == heldout:
                return p
        raise RuntimeError(f"{self.name}: no {'held-out' if heldout else 'training'} problem found; "
                           f"heldout_fraction={self.heldout_fraction} leaves that split empty")

    def eval_set(self, n: int, seed: int = 1234) -> list[Problem]:
        """Up to n distinct held-out problems (fewer if the held-out split is smaller), in a fixed order."""
        rng, seen = np.random.default_rng(seed), {}
        for _ in range(50 * n):
            p = self.random_problem(rng)
            if self.is_heldout(p):
                seen.setdefault(p.prompt, p)
                if len(seen) == n:
                    break
        if not seen:
            raise RuntimeError(f"{self.name}: the held-out split is empty (heldout_fraction={self.heldout_fraction})")
        return list(seen.values())


class Arithmetic(Task):
    name = "arithmetic"

    def __init__(self, low: int = 0, high: int = 9, ops: str = "+", max_result: int | None = None,
                 heldout_fraction: float = 0.2):
        super().__init__(heldout_fraction)
        if not 0 <= low <= high:
            raise ConfigError(f"ppo.task_args.low={low}, high={high}: need 0 <= low <= high")
        if not ops or set(ops) - set("+-*"):
            raise ConfigError(f"ppo.task_args.ops={ops!r}: one or more of '+', '-', '*' (one per gap between operands)")
        if max_result is not None and not isinstance(max_result, int):
            raise ConfigError(f"ppo.task_args.max_result={max_result!r}: an integer or None")
        self.low, self.high, self.ops, self.max_result = low, high, ops, max_result

    def random_problem(self, rng):
        for _ in range(1000):
            xs = rng.integers(self.low, self.high + 1, len(self.ops) + 1)
            expr = str(xs[0]) + "".join(op + str(x) for op, x in zip(self.ops, xs[1:]))
            value = safe_eval(expr)
            if self.max_result is None or value <= self.max_result:
                return Problem(expr + "=", str(value))
        raise ConfigError(f"ppo.task_args.max_result={self.max_result}: (almost) no problem has a result that small")


class Reverse(Task):
    name = "reverse"

    def __init__(self, min_len: int = 2, max_len: int = 5, alphabet: str = "abcde", heldout_fraction: float = 0.2):
        super().__init__(heldout_fraction)
        if not 1 <= min_len <= max_len:
            raise ConfigError(f"ppo.task_args.min_len={min_len}, max_len={max_len}: need 1 <= min_len <= max_len")
        if not alphabet or "=" in alphabet:
            raise ConfigError(f"ppo.task_args.alphabet={alphabet!r}: non-empty, without '='")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

    def string(self, rng) -> str:
        n = rng.integers(self.min_len, self.max_len + 1)
        return "".join(rng.choice(list(self.alphabet), n))

    def random_problem(self, rng):
        s = self.string(rng)
        return Problem(f"rev:{s}=", s[::-1])


class Sort(Reverse):
    name = "sort"

    def __init__(self, min_len: int = 2, max_len: int = 5, alphabet: str = "123456789", heldout_fraction: float = 0.2):
        super().__init__(min_len, max_len, alphabet, heldout_fraction)

    def random_problem(self, rng):
        s = self.string(rng)
        return Problem(f"sort:{s}=", "".join(sorted(s)))


# the built-in demos; every task, "prompts" included: glmjax.rl.prompts.TASKS
DEMO_TASKS: dict[str, type[Task]] = {"arithmetic": Arithmetic, "reverse": Reverse, "sort": Sort}


def safe_eval(expr: str) -> int:
    """Integer +, -, * with the usual precedence, nothing else (no eval): "3*4+5" -> 17. ValueError otherwise."""
    if not expr or len(expr) > 64 or set(expr) - set("0123456789+-*"):
        raise ValueError(f"not an integer +,-,* expression: {expr!r}")
    total, term, sign = 0, None, 1
    for chunk in _split_keep(expr, "+-"):
        if chunk in "+-":
            if term is None:
                raise ValueError(f"bad expression {expr!r}")
            total, term, sign = total + sign * term, None, (1 if chunk == "+" else -1)
            continue
        factors = chunk.split("*")
        if any(not f.isdigit() for f in factors):
            raise ValueError(f"bad expression {expr!r}")
        term = math.prod(int(f) for f in factors)
    if term is None:
        raise ValueError(f"bad expression {expr!r}")
    return total + sign * term


def _split_keep(s: str, seps: str) -> list[str]:
    out, cur = [], ""
    for ch in s:
        if ch in seps:
            out += [cur, ch] if cur else [ch]
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur else [])


# ----------------------------------------------------------------------------------------------- rewards

def exact_reward(response: str, problem: Problem) -> float:
    """1 if the response is exactly the answer (surrounding whitespace ignored), else 0."""
    return float(response.strip() == problem.answer)


def partial_reward(response: str, problem: Problem) -> float:
    """Per-position credit: matching characters / max(len(response), len(answer)) -- 1 only for the exact answer."""
    r, a = response.strip(), problem.answer
    if not r and not a:
        return 1.0
    return sum(x == y for x, y in zip(r, a)) / max(len(r), len(a))


REWARDS: dict[str, Callable[[str, Problem], float]] = {"exact": exact_reward, "partial": partial_reward}


def import_path(spec: str, field: str):
    """"package.module:name" -> the object; ConfigError naming the field if it does not import (missing, or the
    module's own code raised)."""
    mod, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except Exception as e:  # noqa: BLE001 -- a module that fails at import: the user's code
        raise ConfigError(f"ppo.{field}={spec!r}: cannot import ({type(e).__name__}: {e})") from e


def resolve_callable(spec: str, registry: dict, field: str):
    """A registry name, or "package.module:function" imported on the spot; ConfigError names the field otherwise."""
    if spec in registry:
        return registry[spec]
    if ":" in spec:
        fn = import_path(spec, field)
        if callable(fn):
            return fn
        raise ConfigError(f"ppo.{field}={spec!r}: is a {type(fn).__name__}, not a function")
    raise ConfigError(f"ppo.{field}={spec!r}: must be one of {sorted(registry)} or 'package.module:function'")


def resolve_tools(spec: str) -> dict:
    """"package.module:NAME" -> the dict {tool name: fn(argument, problem) -> str} it names (ppo.tools)."""
    tools = import_path(spec, "tools")
    if not isinstance(tools, dict) or not all(isinstance(k, str) and k and callable(v) for k, v in tools.items()):
        raise ConfigError(f"ppo.tools={spec!r}: must name a dict {{tool name: fn(argument, problem) -> str}}")
    return tools
