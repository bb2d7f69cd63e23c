"""PPO on your own prompts, without a model: the prompts JSONL (rows, held-out split, errors naming file:line), the
reward and tools given by import path (errors; the interceptor guards the user's tools), and the token rule of an
HF tokenizer -- prompts and tool episodes rendered by the chat template equal transformers' apply_chat_template."""
import json
import sys

import numpy as np
import pytest
from hf_tokenizer_fixture import write_tokenizer

from glmjax.config import ConfigError
from glmjax.data.chat import ChatTemplate
from glmjax.data.hf_tokenizer import HFTokenizer
from glmjax.data.sources import DataError
from glmjax.rl.chat_env import ChatToolEnv
from glmjax.rl.config import default_ppo_config, validate_ppo_config
from glmjax.rl.env import SingleTurnEnv
from glmjax.rl.interceptor import Interceptor
from glmjax.rl.prompts import PromptsTask
from glmjax.rl.tasks import REWARDS, Problem, resolve_callable, resolve_tools
from glmjax.rl.text import ChatText
from helpers import TINY


@pytest.fixture(scope="module")
def text(tok_dir):
    tok = HFTokenizer(tok_dir)
    return ChatText(tok, ChatTemplate(tok.chat_template, tok.chat_template_file, tok.special_tokens))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(30)] + [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
     "answer": "Paris", "aliases": ["paris"]}]


def test_prompts_rows_split_and_problem_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:15] + [""] + ROWS[15:])  # a blank line is skipped
    task = PromptsTask(path, fields=("answer",), heldout_fraction=0.3)
    assert len(task.rows) == 31 and [r.where for r in task.rows[14:16]] == [f"{path}:15", f"{path}:17"]
    chat = task.rows[-1]
    assert chat.answer == "Paris" and chat.row["aliases"] == ["paris"]
    assert chat.messages[1]["content"] == "Capital of France?"
    assert task.rows[0].messages == [{"role": "user", "content": "What is 0 + 1?"}]
    held = {r.prompt for r in task.splits[True]}
    assert held and len(held) < 31 and held == {r.prompt for r in task.rows if task.is_heldout(r)}
    rng = np.random.default_rng(0)
    assert all(task.sample(rng).prompt not in held for _ in range(50))
    assert [r.prompt for r in task.eval_set(3)] == [r.prompt for r in task.rows if r.prompt in held][:3]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x"}, r":1: missing field 'answer'"),
    ('{"prompt": "x", ', r":1: not valid JSON"),
    ([1, 2], r":1: a JSON list, not an object"),
    ({"answer": "1"}, r":1: needs exactly one of 'messages'"),
    ({"prompt": "x", "messages": [], "answer": "1"}, r":1: needs exactly one of 'messages'"),
    ({"prompt": 3, "answer": "1"}, r":1: field 'prompt' must be a non-empty string"),
    ({"messages": [{"role": "narrator", "content": "x"}], "answer": "1"},
     r":1: field 'messages'\[0\].role='narrator': unknown role"),
])
def test_bad_prompt_rows_name_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(DataError, match=f"{tmp_path}/p.jsonl{message}"):
        PromptsTask(path, fields=("answer",))


def test_reward_and_tools_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "user_rl.py").write_text(
        "LIMIT = 3\n"
        "def half(response, problem):\n    return 0.5\n"
        "def text(response, problem):\n    return 'good'\n"
        "def nan(response, problem):\n    return float('nan')\n"
        "def ratio(response, problem):\n    return 1 / len(problem.answer)\n"
        "TOOLS = {'lookup': lambda arg, problem: arg.upper()}\n")
    (tmp_path / "user_broken.py").write_text("def f(response, problem):\n    return 1.0\nvalue = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_rl", None)
    assert resolve_callable("user_rl:half", REWARDS, "reward")("x", None) == 0.5
    with pytest.raises(ConfigError, match=r"ppo.reward='user_rl:nope': cannot import \(AttributeError"):
        resolve_callable("user_rl:nope", REWARDS, "reward")
    with pytest.raises(ConfigError, match=r"ppo.reward='no_such_module:f': cannot import \(ModuleNotFoundError"):
        resolve_callable("no_such_module:f", REWARDS, "reward")
    with pytest.raises(ConfigError, match=r"ppo.reward='user_broken:f': cannot import \(NameError: name "
                                          "'undefined_name' is not defined"):  # the module's own code raised
        resolve_callable("user_broken:f", REWARDS, "reward")
    with pytest.raises(ConfigError, match=r"ppo.reward='user_rl:LIMIT': is a int, not a function"):
        resolve_callable("user_rl:LIMIT", REWARDS, "reward")
    assert resolve_tools("user_rl:TOOLS")["lookup"]("ab", None) == "AB"
    with pytest.raises(ConfigError, match=r"ppo.tools='user_rl:half': must name a dict"):
        resolve_tools("user_rl:half")
    problem = Problem("q", "a", {"prompt": "q"}, "p.jsonl:7")
    for name, shown in (("text", r"'good' \(str\)"), ("nan", r"nan \(float\)")):
        env = SingleTurnEnv(problem, resolve_callable(f"user_rl:{name}", REWARDS, "reward"))
        env.step([ord("x"), 257])
        with pytest.raises(ConfigError, match=rf"reward user_rl:{name} returned {shown} for p.jsonl:7: must be a "
                                              "finite number"):
            env.reward()
    env = SingleTurnEnv(Problem("q", "", {"prompt": "q"}, "p.jsonl:9"), resolve_callable("user_rl:ratio", REWARDS,
                                                                                          "reward"))
    env.step([ord("x"), 257])  # a row whose answer is empty: the user's function divides by zero
    with pytest.raises(ConfigError, match=r"^reward user_rl:ratio raised ZeroDivisionError \(division by zero\) on "
                                          r"p.jsonl:9$"):
        env.reward()


def test_ppo_config_rules_for_user_tasks():
    def config(**kw):
        import ml_collections

        return ml_collections.ConfigDict(dict(model=dict(TINY), ppo=default_ppo_config(**kw)))

    validate_ppo_config(config(task="prompts", tokenizer="hf:/x", env="tool", tools="m:T"))
    for kw, message in (({"tokenizer": "sentencepiece"}, "ppo.tokenizer='sentencepiece': must be 'byte' or 'hf:DIR'"),
                        ({"tokenizer": "hf:/x", "sft_steps": 5}, "ppo.sft_steps=5: the supervised warm-up"),
                        ({"tools": "m:T"}, "ppo.tools='m:T': tools are offered in the tool environment"),
                        ({"tools": "T", "env": "tool"}, "ppo.tools='T': must be None or 'package.module:name'")):
        with pytest.raises(ConfigError, match=message):
            validate_ppo_config(config(**kw))


def test_chat_prompts_and_responses_use_the_template_and_tokenizer(text, ref):
    row = ROWS[-1]
    problem = Problem("", "Paris", row)
    want = ref.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)
    env = SingleTurnEnv(problem, lambda response, p: float(response == p.answer), text)
    assert env.prompt() == list(want["input_ids"]) and env.stop_tokens == (text.eos_id,)
    env.step(text.encode("Paris") + [text.eos_id])
    assert env.answer == "Paris" and env.reward() == 1.0


def test_tool_episode_renders_like_apply_chat_template_and_is_intercepted(text, ref):
    ran = []
    tools = {"cat": lambda arg, p: ran.append(arg) or "secret", "lookup": lambda arg, p: f"<{arg}>"}
    problem = Problem("How tall is the tower?", "330", {"prompt": "How tall is the tower?"})
    env = ChatToolEnv(problem, lambda response, p: float(response.strip() == p.answer), text, Interceptor(),
                      tools=tools)
    ids = env.prompt()
    turns = ["lookup:tower height", "cat:solution.txt", "calc:300+30", "330"]
    for turn in turns:
        ids += text.encode(turn) + [text.eos_id]
        obs = env.step(text.encode(turn) + [text.eos_id])
        ids += obs or []
    assert obs is None and env.reward() == 1.0 and env.info["tool_calls"] == 3
    assert ran == [] and [r["rule"] for r in env.info["interceptions"]] == ["protected_file"]  # user tool guarded
    outputs = ["<tower height>", "none", "330"]  # "none": the interceptor's dummy output
    conversation = [{"role": "user", "content": problem.prompt}]
    for turn, out in zip(turns, outputs):
        conversation += [{"role": "assistant", "content": turn}, {"role": "tool", "content": out}]
    conversation.append({"role": "assistant", "content": "330"})
    want = ref.apply_chat_template(conversation, tokenize=False)
    got = text.tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    assert got == want.rstrip("\n")  # the template's "\n" after the final EOS is not the policy's to write


def test_tokenizer_larger_than_the_model_and_missing_template_are_refused(tok_dir, tmp_path):
    from glmjax.rl.ppo import build_text

    vocab = HFTokenizer(tok_dir).vocab_size
    p = default_ppo_config(tokenizer="hf:" + tok_dir)
    with pytest.raises(ConfigError, match=rf"ppo.tokenizer='hf:{tok_dir}': its vocab_size {vocab} exceeds "
                                          rf"model.vocab_size={vocab - 1}"):
        build_text(p, vocab - 1)
    assert build_text(p, vocab).template is not None
    plain = write_tokenizer(tmp_path / "plain", chat_template=None)
    assert build_text(default_ppo_config(tokenizer="hf:" + plain), vocab).template is None  # BOS + prompt text
    with pytest.raises(DataError, match="has no chat template"):
        build_text(default_ppo_config(tokenizer="hf:" + plain, env="tool"), vocab)


def test_a_chat_tool_episode_compacts_through_the_template(text, ref):
    """ChatToolEnv with a budget that the fifth call's result overflows (compaction.py, keep_last:1): the next
    sub-trajectory's prompt is the template's rendering (transformers' apply_chat_template) of the task, a user
    message summarising the first four calls, and the fifth with its result; the episode then ends in it."""
    from glmjax.rl.compaction import COMPACT, Budget, chat_rule

    problem = Problem("How tall is the tower?", "330", {"prompt": "How tall is the tower?"})
    tools = {"lookup": lambda arg, p: f"<{arg}>"}
    names = ["tower", "height", "base", "roof", "spire"]
    calls = [text.encode(f"lookup:{n}") + [text.eos_id] for n in names]
    probe = ChatToolEnv(problem, lambda response, p: 0.0, text, max_calls=9, tools=tools)  # token counts
    used = len(probe.prompt()) + sum(len(c) + len(probe.step(c)) for c in calls[:-1])
    last = len(calls[-1]) + len(probe.step(calls[-1]))
    env = ChatToolEnv(problem, lambda response, p: float(response.strip() == p.answer), text, max_calls=9, tools=tools)
    env.budget = Budget(used + last + 8 - 1, chat_rule("keep_last:1", env), 8, text)  # one token short at call 5
    first = env.prompt()
    assert all(env.step(c) not in (None, COMPACT) for c in calls[:-1]) and env.step(calls[-1]) is COMPACT
    summary = "[earlier: 4 turns, the last 2: lookup:base -> <base>; lookup:roof -> <roof>]"
    conversation = [{"role": "user", "content": problem.prompt}, {"role": "user", "content": summary},
                    {"role": "assistant", "content": "lookup:spire"}, {"role": "tool", "content": "<spire>"}]
    want = ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert env.prompt() == list(want["input_ids"]) != first
    assert env.step(text.encode("330") + [text.eos_id]) is None and env.reward() == 1.0
