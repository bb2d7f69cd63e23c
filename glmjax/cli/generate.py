"""Generate a continuation of one prompt (`glmjax-generate`, or `python -m glmjax.cli.generate`):

  glmjax-generate --checkpoint runs/x/sft --prompt "Hello"                       # a stage workdir, byte tokenizer
  glmjax-generate --checkpoint ckpt/ --tokenizer hf:path/to/GLM-5 --chat --prompt "Hi" --temperature 0.7 --top-p 0.9

--checkpoint is a stage or PPO workdir (its newest intact checkpoint; a PPO run's holds its policy), a directory
written by `glmjax-hf import` (or a PPO run's policy/), or a Hugging Face checkpoint (config.json + safetensors).
The prompt is encoded with BOS and without EOS; with --chat it is one user message rendered by the tokenizer's chat
template with add_generation_prompt=True (no BOS added: the template writes its own). Generation stops at the
tokenizer's EOS or after --max-new-tokens; the decoded answer is printed. Temperature 0 is greedy. --speculative D
(greedy only) drafts D tokens per step with the model's MTP layer and verifies them in one pass of the main model:
the same tokens, fewer passes. Errors end in one line on stderr and exit status 2 (3: no intact checkpoint).
"""
from __future__ import annotations

import argparse
import json
import sys

import jax

from glmjax.cli.runtime import configure_jax
from glmjax.data.chat import ChatTemplate
from glmjax.data.tokenizer import make_tokenizer
from glmjax.infer import Decoder, generate
from glmjax.resolve import load_model
from glmjax.workdir import CheckpointError


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt, bos=True, eos=False).tolist()
    template = ChatTemplate(getattr(tokenizer, "chat_template", None), getattr(tokenizer, "directory", "byte"),
                            getattr(tokenizer, "special_tokens", {}), for_training=False)
    return tokenizer.encode(template.prompt([{"role": "user", "content": prompt}]), bos=False, eos=False).tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="glmjax-generate", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="stage workdir, imported checkpoint or HF checkpoint dir")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--tokenizer", default="byte", help="'byte' or 'hf:DIR' (a tokenizer.json directory)")
    ap.add_argument("--chat", action="store_true", help="render the prompt as one user message (chat template)")
    ap.add_argument("--mode", default="sparse", choices=("sparse", "dense"), help="attention of the decoder")
    ap.add_argument("--speculative", type=int, default=0, metavar="D",
                    help="draft D tokens per step with the model's MTP layer, verified in one pass (greedy only: the "
                    "output equals plain greedy decoding's); 0 = off")
    ap.add_argument("--ids", action="store_true", help="also print the generated token ids (a JSON list)")
    ap.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache (default: "
                    "~/.cache/glmjax/jax_cache, see glmjax/cli/runtime.py); empty = off")
    args = ap.parse_args(argv)
    configure_jax(args.compilation_cache)
    try:
        tokenizer = make_tokenizer(args.tokenizer)
        ids = prompt_ids(tokenizer, args.prompt, args.chat)
        model = load_model(args.checkpoint, "--checkpoint")[0]
        out = generate(Decoder(model, args.mode), [ids], args.max_new_tokens, key=jax.random.key(args.seed),
                       temperature=args.temperature, top_p=args.top_p, stop_tokens=[tokenizer.eos_id],
                       pad_id=tokenizer.pad_id, speculative=args.speculative)
        answer = out.tokens[0, :out.lengths[0]]
        known = answer[answer < tokenizer.vocab_size]
        if len(known) < len(answer):
            print(f"note: {len(answer) - len(known)} generated ids are >= the tokenizer's vocab_size "
                  f"{tokenizer.vocab_size} (the model's is {model.cfg.vocab_size}) and are left out of the text",
                  file=sys.stderr)
        print(tokenizer.decode(known))
    except CheckpointError as e:  # SafetensorsFormatError (a damaged file) is one
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, ValueError) as e:  # ConfigError, DataError, HFCheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ids:
        print(json.dumps(answer.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
