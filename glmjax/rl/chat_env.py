"""ChatToolEnv: multi-turn tool episodes with a configured tokenizer, every turn rendered by the chat template.

The prompt is the problem's conversation rendered with add_generation_prompt=True. Each policy turn ends at the
tokenizer's EOS and is decoded; a turn whose text is one line "<tool>:<argument>" naming an offered tool (the
built-in calc / read / fetch of ToolEnv, and ppo.tools) is a tool call: the conversation gets the turn as an
assistant message and the tool's output as a tool message, and the observation fed to the policy (loss mask 0) is
what the template writes after the turn (glmjax/rl/text.py ChatText.observation). Any other turn is the final
answer. The interceptor checks every call first, the user's tools included. With a Budget (compaction.py,
`chat_rule`), an episode that outgrows its context goes on from its compacted conversation, rendered by the
template.
"""
from __future__ import annotations

from typing import Sequence

from glmjax.rl.compaction import COMPACT
from glmjax.rl.env import EnvCrash, ToolEnv

BUILTIN_TOOLS = ("calc", "read", "fetch")


class ChatToolEnv(ToolEnv):
    def __init__(self, problem, reward_fn, text, interceptor=None, max_calls=3, crash_prob=0.0, rng=None,
                 tools=None, budget=None):
        super().__init__(problem, reward_fn, interceptor, max_calls, crash_prob, rng, tools, text, budget)
        self.stop_tokens = (text.eos_id,)
        self.messages = list(problem.messages)
        self.offered = set(BUILTIN_TOOLS) | set(self.tools)

    def step(self, turn: Sequence[int]) -> list[int] | None:
        content = self.text.decode(turn)
        tool, sep, _ = content.partition(":")
        if not sep or tool not in self.offered or "\n" in content.strip():
            self.answer = content
            return None
        self.info["tool_calls"] += 1
        if self.info["tool_calls"] > self.max_calls:
            return None  # over the tool budget: the episode ends without an answer
        if self.crash_prob and self.rng.random() < self.crash_prob:
            raise EnvCrash("simulated tool-server crash")
        output = self.run_tool(content.strip())
        self.messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": output}]
        obs = self.text.observation(self.messages, self.problem.row.get("tools") if self.problem.row else None)
        return COMPACT if self.budget is not None and self.budget.after_turn(turn, obs) else obs
