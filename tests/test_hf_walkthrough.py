"""The README walkthrough as one test: from a Hugging Face checkpoint to a post-trained one and back.

1. a random tiny `glm_moe_dsa` checkpoint saved with transformers, and a small byte-level BPE tokenizer trained with
   `tokenizers` on the embedded corpus saved beside it with a chat template (tests/hf_tokenizer_fixture.py);
2. `glmjax-hf import`;
3. SFT on a chat JSONL (stage "sft", data.tokenizer="hf:DIR"): the loss falls, and the pipeline's ids and loss mask
   are transformers' apply_chat_template(..., return_assistant_tokens_mask=True);
4. PPO on a prompts JSONL with a reward given by import path (a module written into tmp_path): the reward rises;
5. `glmjax-hf export` of the policy PPO wrote; transformers loads the exported directory and its greedy generation
   equals glmjax-generate's, token for token.
The task: SFT teaches "pick a letter" with A, B, C, D equally often; the reward pays for the row's answer, B.
"""
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_tokenizer_fixture import write_tokenizer  # noqa: E402

from configs import ppo_prompts, sft_chat  # noqa: E402
from glmjax.cli import generate as gen_cli  # noqa: E402
from glmjax.cli import hf as hf_cli  # noqa: E402
from glmjax.data import make_pipeline  # noqa: E402
from glmjax.data.hf_tokenizer import HFTokenizer  # noqa: E402
from glmjax.launch import run  # noqa: E402

SEED = int(os.environ.get("GLMJAX_WALKTHROUGH_SEED", "0"))  # the test runs seed 0; 1 and 2 were checked as well
LETTERS = "ABCD"  # one token each
THINGS = ("car", "door", "kite", "ball", "cup", "hat", "boat", "lamp", "sock", "fish", "bike", "rug", "pen", "box",
          "bag", "toy", "bowl", "desk", "wall", "bird")
SEQ = 48  # SFT rows, PPO prompt + response, index_topk (so DSA selects every key: transformers' and glmjax's agree)
MODE = "dense"  # = sparse attention here (index_topk = SEQ), and compiles faster
HF_MODEL = dict(  # tests/test_interop.py's GLM_TINY, smaller
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    index_n_heads=4, index_head_dim=16, index_topk=SEQ, indexer_types=["full", "shared"],
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, max_position_embeddings=SEQ,
    rms_norm_eps=1e-5, num_nextn_predict_layers=0, tie_word_embeddings=False, attention_bias=False)
SFT_STEPS, SFT_LR, PPO_STEPS, PPO_LR = 16, 1e-2, 10, 5e-3
REWARD_MODULE = '''
def reward(response, problem):
    """1 if the answer starts with the row's reference word, else 0."""
    return float(response.strip().startswith(problem.row["answer"]))
'''


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def question(thing):
    return f"Pick a letter for the {thing}."


def released_checkpoint(root):
    """1. weights saved by transformers, tokenizer + chat template beside them -> (its directory, HFTokenizer)."""
    hf_dir = write_tokenizer(os.path.join(root, "hf"), vocab_size=300)
    tok = HFTokenizer(hf_dir)
    torch.manual_seed(SEED)
    cfg = transformers.GlmMoeDsaConfig(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                       pad_token_id=tok.pad_id, **HF_MODEL)
    transformers.GlmMoeDsaForCausalLM(cfg).float().save_pretrained(hf_dir)
    return hf_dir, tok


def sft_config(root, hf_dir, steps=SFT_STEPS, lr=SFT_LR):
    """configs/sft_chat.py on the imported checkpoint, at the test's size -> (config, the chat records)."""
    rng = np.random.default_rng(SEED)
    chats = [{"messages": [{"role": "user", "content": question(THINGS[i % len(THINGS)])},
                           {"role": "assistant", "content": LETTERS[rng.integers(4)]}]} for i in range(64)]
    c = sft_chat.get_config(os.path.join(root, "imported"))
    c.data.update(path=write_jsonl(os.path.join(root, "chat.jsonl"), chats), tokenizer="hf:" + hf_dir,
                  eval_fraction=0.0, prefetch=0, shuffle=False,
                  shuffle_window_tokens=1 << 10)  # the default 8M-token window would repeat 64 chats for a minute
    c.optim.update(lr=lr, warmup_steps=3)
    c.train.update(seq_len=SEQ, mode=MODE, steps=steps, log_every=1, eval_every=0, eval_batches=0,
                   checkpoint_every=steps, async_checkpoints=False, tensorboard=False)
    c.parallel.num_devices = 1
    return c, chats


def ppo_config(root, hf_dir, steps=PPO_STEPS, lr=PPO_LR):
    """configs/ppo_prompts.py from the SFT workdir, at the test's size."""
    prompts = [{"prompt": question(t), "answer": "B"} for t in THINGS]
    prompts[1] = {"messages": [{"role": "user", "content": question(THINGS[1])}], "answer": "B"}
    c = ppo_prompts.get_config(os.path.join(root, "imported"))
    c.optim.update(lr=lr, warmup_steps=1)
    c.ppo.task_args.path = write_jsonl(os.path.join(root, "prompts.jsonl"), prompts)
    c.ppo.update(tokenizer="hf:" + hf_dir, reward="walk_reward:reward", init_checkpoint=os.path.join(root, "sft"),
                 mode=MODE, seed=SEED, steps=steps, prompts_per_step=4, group_size=4, max_prompt_len=SEQ - 8,
                 max_response_len=8, target_kl=None, eval_every=0, eval_problems=4, eval_samples=1)
    return c


def jsonl_values(path, key):
    with open(path) as f:
        return [r[key] for r in map(json.loads, f) if key in r]


@pytest.mark.slow
def test_hf_checkpoint_to_post_trained_and_back(tmp_path, monkeypatch, capsys):
    root = str(tmp_path)
    hf_dir, tok = released_checkpoint(root)

    # 2. import
    assert hf_cli.main(["import", hf_dir, os.path.join(root, "imported")]) == 0

    # 3. SFT on chat data: the pipeline's ids and mask are transformers', the loss falls
    sft, chats = sft_config(root, hf_dir)
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    batch = next(iter(make_pipeline(sft.data, SEQ, 4, seed=0, num_epochs=1)))
    segment = batch["segment_ids"][0] == 1
    want = ref.apply_chat_template(chats[0]["messages"], tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    assert batch["tokens"][0][segment].tolist() == list(want["input_ids"])  # the first conversation, unshuffled
    assert batch["loss_mask"][0][segment].tolist() == list(want["assistant_masks"])  # (BOS: never a target)
    run(sft, os.path.join(root, "sft"), progress=False)
    losses = jsonl_values(os.path.join(root, "sft", "metrics.jsonl"), "loss")
    assert np.mean(losses[-3:]) < 0.3 * np.mean(losses[:3]), losses

    # 4. PPO on your own prompts, reward by import path
    (tmp_path / "walk_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(root)
    summary = run(ppo_config(root, hf_dir), os.path.join(root, "ppo"), progress=False)
    rewards = jsonl_values(os.path.join(root, "ppo", "metrics.jsonl"), "reward_mean")
    assert np.mean(rewards[:3]) < 0.5 and np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.25, rewards

    # 5. export; transformers generates what glmjax generates
    policy, exported = os.path.join(root, "ppo", "policy"), os.path.join(root, "exported")
    assert hf_cli.main(["export", policy, exported, "--dtype", "F32"]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(hf_dir, name), exported)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    capsys.readouterr()
    for thing in ("tree",):  # a thing PPO never saw
        msgs = [{"role": "user", "content": question(thing)}]
        ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                    eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        want = out[0, len(ids):].tolist()
        assert gen_cli.main(["--checkpoint", policy, "--tokenizer", "hf:" + exported, "--chat", "--prompt",
                             question(thing), "--max-new-tokens", "8", "--mode", MODE, "--ids"]) == 0
        text, got = capsys.readouterr().out.splitlines()
        assert got == json.dumps(want), (thing, text)
    assert summary["final_version"] == PPO_STEPS


def test_inspect_reads_the_released_checkpoint(tmp_path, capsys):
    """Step 1 and `glmjax-hf inspect` alone: the ModelConfig it prints has the saved checkpoint's shapes and the
    tokenizer's vocabulary."""
    hf_dir, tok = released_checkpoint(str(tmp_path))
    assert hf_cli.main(["inspect", hf_dir]) == 0
    out = capsys.readouterr().out
    cfg = json.loads(out[:out.index("\n}") + 2])
    assert cfg["vocab_size"] == tok.vocab_size
    for k in ("hidden_size", "num_hidden_layers", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim"):
        assert cfg[k] == HF_MODEL[k], k
