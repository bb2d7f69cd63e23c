"""Compaction (GLM-5.2, docs/ppo.md "Compaction"): when an episode's next turn would not fit its context budget, the
history is compacted and the episode goes on in a new sub-trajectory whose prompt is the compacted conversation.

A rule maps the episode so far to the next sub-trajectory's prompt tokens:

    rule(prompt, turns, text) -> tokens
      prompt  the episode's first prompt (system prompt and task, as the environment rendered it)
      turns   every (policy turn, observation) of the episode so far, oldest first, token ids; the last one's
              observation has not been fed to the policy yet
      text    the environment's token rule (glmjax/rl/text.py)

The built-in `keep_last(k)` ("keep_last:K") keeps the first prompt and the last k turns verbatim
and replaces the turns before them by one summary line written by a rule (how many, and the last SUMMARY_TURNS
calls with the start of their outputs); "policy_summary:K" has the policy write that summary itself (`Budget`). A
rule is also "package.module:function". The new prompt always ends with
the last observation, so the environment's answer to the last turn is never lost; its tokens are prompt tokens
(loss mask 0).
"""
from __future__ import annotations

from typing import Callable, Sequence

from glmjax.config import ConfigError
from glmjax.rl.tasks import resolve_callable
from glmjax.rl.text import decode, encode

Rule = Callable[[list[int], list[tuple[list[int], list[int]]], object], list[int]]
SUMMARY_CHARS = 24  # of each earlier call and of its output, in the summary line
SUMMARY_TURNS = 2  # the earlier turns the summary line shows (it counts them all)


def keep_last(k: int) -> Rule:
    if k < 1:
        raise ConfigError(f"compaction rule 'keep_last:{k}': k must be >= 1 (the last turn holds the observation the "
                          "policy has not seen yet)")

    def rule(prompt: list[int], turns: Sequence[tuple[list[int], list[int]]], text) -> list[int]:
        earlier, kept = turns[:-k], turns[-k:]
        out = list(prompt)
        if earlier:
            out += encode(summary(earlier))
        for turn, obs in kept:
            out += list(turn) + list(obs)
        return out

    return rule


def summary(turns: Sequence[tuple[list[int], list[int]]]) -> str:
    """One line of bounded length: '[earlier: 6 turns, the last 2: calc:5+0 -> 5; calc:6+0 -> 6]\\n' (byte text)."""
    return summary_text([(decode(t), decode(o).strip().lstrip("=")) for t, o in turns]) + "\n"


def summary_text(calls: Sequence[tuple[str, str]]) -> str:
    """(call, output) texts -> '[earlier: N turns, the last 2: call -> output; ...]', each shortened to
    SUMMARY_CHARS."""
    last = calls[-SUMMARY_TURNS:]
    return (f"[earlier: {len(calls)} turn{'s' * (len(calls) > 1)}, the last {len(last)}: "
            + "; ".join(f"{c.strip()[:SUMMARY_CHARS]} -> {o.strip()[:SUMMARY_CHARS]}" for c, o in last) + "]")


def compact_messages(task: list[dict], messages: list[dict], k: int) -> list[dict]:
    """A chat episode's compacted conversation: the task's messages (system prompt and task), one user message
    summarising the tool turns before the last k (`summary_text`), the last k (assistant, tool) pairs."""
    pairs = [messages[i:i + 2] for i in range(len(task), len(messages), 2)]
    earlier, kept = pairs[:-k], pairs[-k:]
    out = list(task)
    if earlier:
        out.append({"role": "user", "content": summary_text([(a["content"], t["content"]) for a, t in earlier])})
    for pair in kept:
        out += pair
    return out


def chat_rule(spec: str, env) -> Rule:
    """The rule of a chat tool environment (glmjax/rl/chat_env.py): "keep_last:K" compacts its messages and renders
    them with the chat template (add_generation_prompt: the prompt ends with the last tool result and the next
    assistant header); a user rule gets the tokens, as in the byte environment."""
    name, _, arg = spec.partition(":")
    if name != "keep_last":
        return make_rule(spec)
    make_rule(spec)  # the same checks of K
    k = int(arg)

    def rule(prompt: list[int], turns, text) -> list[int]:
        tools = env.problem.row.get("tools") if env.problem.row else None
        return text.encode(text.template.prompt(compact_messages(list(env.problem.messages), env.messages, k), tools))

    return rule


def make_rule(spec: str) -> Rule:
    """A compaction rule by name -> the rule: "keep_last:K" or "package.module:function"."""
    name, colon, arg = spec.partition(":")
    if name == "keep_last":
        try:
            k = int(arg)
        except ValueError:
            raise ConfigError(f"compaction rule {spec!r}: keep_last takes an integer, e.g. 'keep_last:2'") from None
        return keep_last(k)
    if not colon:
        raise ConfigError(f"compaction rule {spec!r}: 'keep_last:K' or 'package.module:function'")
    return resolve_callable(spec, {}, "compaction")


def make_budget(spec: str, context_budget: int, headroom: int, text=None) -> "Budget":
    """ppo.compaction -> an episode's Budget: "keep_last:K" or "pkg.mod:fn" (a rule), or "policy_summary:K" (the
    policy writes the summary; byte tokens)."""
    name, _, arg = spec.partition(":")
    if name == "policy_summary":
        if not arg.isdigit() or int(arg) < 1:
            raise ConfigError(f"compaction rule {spec!r}: policy_summary takes an integer K >= 1 (the turns kept)")
        return Budget(context_budget, None, headroom, text, policy_summary=int(arg))
    return Budget(context_budget, make_rule(spec), headroom, text)


COMPACT = ("compact",)  # what env.step returns when the episode goes on in a new sub-trajectory


ASK = "[context full: summarise the episode so far in one line]\n"  # the policy's cue to write its summary (bytes)


class Budget:
    """An episode's token accounting for compaction: `context_budget` tokens per sub-trajectory (prompt and
    response), of which `headroom` must stay free for the policy's next turn after an observation. text: the
    environment's token rule, handed to the rule. policy_summary K: the summary is written by the policy itself --
    on overflow the environment shows the observation and ASK (loss mask 0), the policy's next turn is the summary
    (policy tokens of this sub-trajectory), and the next prompt is the task, that summary and the last K turns
    (`summarised`); `headroom` must then hold ASK and the summary."""

    def __init__(self, context_budget: int, rule: Rule | None, headroom: int, text=None,
                 policy_summary: int | None = None):
        self.context_budget, self.rule, self.headroom, self.text = context_budget, rule, headroom, text
        self.policy_summary = policy_summary
        self.summarising = False
        self.first_prompt: list[int] = []
        self.turns: list[tuple[list[int], list[int]]] = []
        self.prompt: list[int] | None = None  # the current sub-trajectory's prompt
        self.used = 0  # tokens of the current sub-trajectory
        self.compactions = self.clipped = 0

    def start(self, prompt: list[int]) -> list[int]:
        """The current sub-trajectory's prompt: `prompt` (the task's) for the first, the compacted conversation
        after a compaction (asking again gives the same)."""
        if self.prompt is None:
            self.first_prompt, self.prompt, self.used = list(prompt), list(prompt), len(prompt)
        return list(self.prompt)

    def after_turn(self, turn: Sequence[int], obs: Sequence[int]) -> bool:
        """Account a turn and its observation -> True when the observation does not fit with `headroom` tokens left
        for the next turn: the episode is compacted (`start` now returns the compacted prompt)."""
        self.turns.append((list(turn), list(obs)))
        self.used += len(turn)
        if self.used + len(obs) + self.headroom <= self.context_budget:
            self.used += len(obs)
            return False
        if self.policy_summary:  # the policy writes the summary first (the environment asks: `summarised`)
            self.summarising = True
            return True
        self._compacted(list(self.rule(self.first_prompt, self.turns, self.text)))
        return True

    def summarised(self, turn: Sequence[int]) -> None:
        """The policy's summary turn (after ASK) -> the next prompt: the task, "[summary: ...]" and the last
        `policy_summary` turns."""
        self.summarising = False
        line = encode(f"[summary: {decode(turn).strip()}]\n")
        kept = [x for pair in self.turns[-self.policy_summary:] for part in pair for x in part]
        self._compacted(self.first_prompt + line + kept)

    def _compacted(self, prompt: list[int]) -> None:
        """The next sub-trajectory's prompt. One that leaves fewer than `headroom` tokens (a long tool output kept,
        a long summary) keeps what it shares with the first prompt (the task) and as much of its end as fits;
        counted in `clipped`."""
        limit = self.context_budget - self.headroom
        if len(prompt) > limit:
            head = next((i for i, (a, b) in enumerate(zip(prompt, self.first_prompt)) if a != b),
                        min(len(prompt), len(self.first_prompt)))
            if head >= limit:
                raise ConfigError(f"compaction: the task's prompt has {head} tokens, leaving fewer than "
                                  f"{self.headroom} for a turn within the context budget of {self.context_budget}")
            prompt = prompt[:head] + prompt[len(prompt) - (limit - head):]
            self.clipped += 1
        self.prompt, self.used = prompt, len(prompt)
        self.compactions += 1
