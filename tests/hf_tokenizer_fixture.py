"""A tiny Hugging Face checkpoint tokenizer for tests: a byte-level BPE trained in memory with `tokenizers` on a few
hundred lines of the embedded corpus (the stdlib), saved as tokenizer.json + tokenizer_config.json with named
special tokens and a chat template that marks assistant text with {% generation %} (system / user / assistant /
tool turns, tool calls, a tools list, reasoning). Loadable by glmjax ("hf:DIR") and by transformers' AutoTokenizer.

    from hf_tokenizer_fixture import write_tokenizer
    directory = write_tokenizer(tmp_path / "tok")
"""
import json
import os

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}"
    "{% generation %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls | default([]) %}"
    "<tool_call>{{ c.function.name }}({{ c.function.arguments | tojson }})</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% endgeneration %}\n"
    "{% elif m.role == 'tool' %}[{{ m.tool_call_id | default('?') }}] {{ m.content }}\n"
    "{% else %}{{ m.content }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# the same template without generation markers (transformers cannot mask it; glmjax refuses it)
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def corpus_lines(n: int = 400) -> list[str]:
    """The first n non-blank lines of the first stdlib files (the embedded corpus), in order."""
    from glmjax.data.sources import stdlib_files

    root, names = stdlib_files()
    out = []
    for name in names:
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            out += [line.rstrip("\n") for line in f if line.strip()]
        if len(out) >= n:
            return out[:n]
    return out


def build_tokenizer(vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    return tok


def write_tokenizer(directory, chat_template: str | None = CHAT_TEMPLATE, vocab_size: int = 600) -> str:
    """Write tokenizer.json and tokenizer_config.json into directory -> its path (str)."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    build_tokenizer(vocab_size).save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "model_max_length": 1 << 20}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return directory


def conversations() -> list[dict]:
    """Records {messages, tools?}: single and multi-turn, a system message, a tool call and its result, unicode,
    reasoning (under the name "reasoning", which transformers also hands the template as reasoning_content)."""
    weather = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}
    return [
        {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                      {"role": "assistant", "content": "It is 4."}]},
        {"messages": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "Name a prime."},
                      {"role": "assistant", "content": "7"},
                      {"role": "user", "content": "Another one, larger than 100?"},
                      {"role": "assistant", "content": "101 -- and 103 as well."}]},
        {"messages": [{"role": "user", "content": "Weather in Zürich?"},
                      {"role": "assistant", "content": None,
                       "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                        "arguments": {"city": "Zürich"}}}]},
                      {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp_c\": 3, \"sky\": \"fog\"}"},
                      {"role": "assistant", "content": "3 °C and foggy."}],
         "tools": [weather]},
        {"messages": [{"role": "user", "content": "def f(x):\n    return x  # explain"},
                      {"role": "assistant", "content": "It returns its argument unchanged.\n\n<|user|> is text here"},
                      {"role": "user", "content": "ok"},
                      {"role": "assistant", "content": "  spaces  and\ttabs "}]},
        {"messages": [{"role": "user", "content": "Is 91 prime?"},
                      {"role": "assistant", "reasoning": "91 = 7 * 13.", "content": "No."}]},
    ]
