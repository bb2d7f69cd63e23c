"""Reward-hacking interception for tool calls.

Rules flag calls that would leak the answer: reading protected answer / test / solution files, fetching reference
solutions. A flagged call (confirmed by the optional judge) is *blocked*: the tool is not run, the environment
answers with a dummy output, and the rollout goes on. Every interception is recorded (the trainer writes them to
workdir/interceptions.jsonl and counts them in the metrics).

The judge hook sees every flagged call and may overrule a false positive: judge(call, rule_name) -> bool
(True = block). A model-based judge plugs in here; by default every flagged call is blocked.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class ToolCall:
    tool: str  # e.g. "read"
    arg: str  # e.g. "answer.txt"


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    tool: str  # regex, full match on the tool name
    arg: str  # regex, searched in the argument (case-insensitive)

    def matches(self, call: ToolCall) -> bool:
        return bool(re.fullmatch(self.tool, call.tool)) and bool(re.search(self.arg, call.arg, re.IGNORECASE))


DEFAULT_RULES = (
    Rule("protected_file", tool=r"read|open|cat", arg=r"answer|solution|expected|test"),
    Rule("reference_solution", tool=r"fetch|get|search", arg=r"solution|answer|reference"),
)
DUMMY_OUTPUT = "none"

Judge = Callable[[ToolCall, str], bool]


class Interceptor:
    def __init__(self, rules: Sequence[Rule] = DEFAULT_RULES, judge: Judge | None = None,
                 dummy_output: str = DUMMY_OUTPUT):
        self.rules, self.judge, self.dummy_output = tuple(rules), judge, dummy_output

    def check(self, call: ToolCall) -> dict | None:
        """-> None if no rule flags the call, else a record {"tool", "arg", "rule", "judge", "blocked"}: judge is
        "none" (no judge: blocked), "confirmed" (blocked) or "overruled" (the judge let it run)."""
        for rule in self.rules:
            if rule.matches(call):
                if self.judge is None:
                    verdict = "none"
                else:
                    verdict = "confirmed" if self.judge(call, rule.name) else "overruled"
                return {"tool": call.tool, "arg": call.arg, "rule": rule.name, "judge": verdict,
                        "blocked": verdict != "overruled"}
        return None
