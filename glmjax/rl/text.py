"""How an episode's text becomes tokens and back: the prompt rule, the stop token, the observation of a tool turn.

ByteText  the built-in tasks' rule: byte tokens (glmjax.data.ByteTokenizer), prompt = BOS + question, stop at EOS.
ChatText  a configured tokenizer (`ppo.tokenizer = "hf:DIR"`): the prompt is the problem's conversation rendered
          by the checkpoint's chat template with add_generation_prompt=True (the template writes its own BOS),
          or, for a tokenizer without a template, BOS + the prompt text; the policy's turn ends at the tokenizer's
          EOS. A tool turn's observation is what the template renders after the policy's turn once the tool
          result is appended: the text after the last {% generation %} block of
          render(messages + [assistant turn, tool result], add_generation_prompt=True).
Responses are decoded with the same tokenizer (special tokens and ids beyond its vocabulary dropped) before a reward
or a tool sees them.
"""
from __future__ import annotations

from typing import Sequence

from glmjax.data.chat import Chat, ChatTemplate
from glmjax.data.sources import Skip
from glmjax.data.tokenizer import ByteTokenizer, Tokenizer
from glmjax.rl.tasks import Problem

TOK = ByteTokenizer()


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=False, eos=False).tolist()


def decode(ids: Sequence[int]) -> str:
    """Text of the byte tokens; special and unused ids (the model's vocabulary may be larger) are dropped."""
    return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class ByteText:
    eos_id, pad_id, vocab_size = TOK.EOS, TOK.PAD, TOK.vocab_size
    template = None

    def prompt(self, problem: Problem) -> list[int]:
        return [TOK.BOS] + encode(problem.prompt)

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)


class ChatText:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None):
        self.tokenizer, self.template = tokenizer, template
        self.eos_id, self.pad_id, self.vocab_size = tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size

    def prompt(self, problem: Problem) -> list[int]:
        if self.template is None:
            return self.tokenizer.encode(problem.prompt, bos=True, eos=False).tolist()
        tools = problem.row.get("tools") if problem.row else None
        return self.encode(self.template.prompt(problem.messages, tools))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, bos=False, eos=False).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    def observation(self, messages: list, tools: list | None) -> list[int]:
        """Tokens the template writes after the last assistant turn of `messages` (its tool results, then the next
        assistant header). ValueError if the template fails or marks no assistant turn."""
        out = self.template.render(Chat(messages, tools), add_generation_prompt=True)
        if isinstance(out, Skip) or not len(out.spans):
            why = out.detail if isinstance(out, Skip) else "no {% generation %} block in the rendered episode"
            raise ValueError(f"tool episode cannot be rendered: {why}")
        return self.encode(out.text[int(out.spans[-1, 1]):])
