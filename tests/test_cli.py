"""The console scripts of pyproject.toml [project.scripts]: each answers --help with exit status 0, and
glmjax-generate gives the tokens of `glmjax.infer.generate` called directly (greedy), with the byte tokenizer and
with an HF tokenizer's chat template."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from glmjax.cli import eval as eval_cli
from glmjax.cli import generate as gen_cli
from glmjax.cli import hf as hf_cli
from glmjax.data.chat import ChatTemplate
from glmjax.data.hf_tokenizer import HFTokenizer
from glmjax.data.tokenizer import ByteTokenizer
from glmjax.infer import Decoder, generate
from glmjax.model import GLM
from helpers import TWO_LAYERS, tiny
from hf_tokenizer_fixture import write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_help_exits_0():
    for argv in (["train.py"], ["-m", "glmjax.cli.train"]):
        out = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "resumes from the newest checkpoint" in out.stdout and "--workdir" in out.stdout


@pytest.mark.parametrize("main", [hf_cli.main, gen_cli.main, eval_cli.main])
def test_help_exits_0(main, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage: glmjax-" in capsys.readouterr().out


def imported_checkpoint(model, path):
    """The directory `glmjax-hf import` writes (model_config.json + state/), without hf_layout.json."""
    import orbax.checkpoint as ocp

    os.makedirs(path)
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.join(path, "state"), nnx.state(model))
    with open(os.path.join(path, "model_config.json"), "w") as f:
        json.dump(model.cfg.to_json_dict(), f)
    return path


def run_cli(argv, capsys):
    assert gen_cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return lines[:-1], json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.parametrize("tok", ["byte", "hf_chat"])
def test_generate_matches_generate_called_directly(tmp_path, capsys, tok):
    model = GLM(tiny(vocab_size=259 if tok == "byte" else 600, num_nextn_predict_layers=0, **TWO_LAYERS), nnx.Rngs(4))
    ckpt = imported_checkpoint(model, str(tmp_path / "ck"))
    if tok == "byte":
        tokenizer, flags = ByteTokenizer(), []
        ids = tokenizer.encode("The sparse indexer", eos=False).tolist()
    else:
        tokenizer = HFTokenizer(write_tokenizer(tmp_path / "tok"))
        flags = ["--tokenizer", f"hf:{tokenizer.directory}", "--chat"]
        text = ChatTemplate(tokenizer.chat_template, "t", tokenizer.special_tokens).prompt(
            [{"role": "user", "content": "The sparse indexer"}])
        assert text.endswith("<|user|>\nThe sparse indexer\n<|assistant|>\n")  # add_generation_prompt=True
        ids = tokenizer.encode(text, bos=False, eos=False).tolist()
    ref = generate(Decoder(model), [ids], 6, key=jax.random.key(0), stop_tokens=[tokenizer.eos_id],
                   pad_id=tokenizer.pad_id)
    want = ref.tokens[0, :ref.lengths[0]].tolist()
    text_lines, got = run_cli(["--checkpoint", ckpt, "--prompt", "The sparse indexer", "--max-new-tokens", "6",
                               "--ids", *flags], capsys)
    assert got == want and len(want) == 6  # no early stop: every step compared
    assert "\n".join(text_lines) == tokenizer.decode(np.array(want))


def test_generate_speculative_prints_plain_greedy(tmp_path, capsys):
    """--speculative 2 drafts with the model's MTP layer: the same ids as plain greedy decoding; a model without an
    MTP layer is refused in one line."""
    model = GLM(tiny(vocab_size=259, **TWO_LAYERS), nnx.Rngs(4))
    ckpt = imported_checkpoint(model, str(tmp_path / "ck"))
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("The sparse indexer", eos=False).tolist()
    ref = generate(Decoder(model), [ids], 8, key=jax.random.key(0), stop_tokens=[tokenizer.eos_id],
                   pad_id=tokenizer.pad_id)
    argv = ["--checkpoint", ckpt, "--prompt", "The sparse indexer", "--max-new-tokens", "8", "--ids"]
    _, got = run_cli(argv + ["--speculative", "2"], capsys)
    assert got == ref.tokens[0, :ref.lengths[0]].tolist()
    plain = imported_checkpoint(GLM(tiny(vocab_size=259, num_nextn_predict_layers=0, **TWO_LAYERS), nnx.Rngs(4)),
                                str(tmp_path / "plain"))
    assert gen_cli.main(["--checkpoint", plain, "--prompt", "x", "--speculative", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "drafts with the MTP layer, and this model has none" in err


def test_generate_errors_in_one_line(tmp_path, capsys):
    assert gen_cli.main(["--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --checkpoint") and "neither a stage or PPO workdir" in err
    assert gen_cli.main(["--checkpoint", str(tmp_path), "--prompt", "x", "--chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err


LIBTPU_NOISE = ("Failed to find host bounds", "unexpected worker hostname", "libtpu", "TPU_WORKER_HOSTNAMES",
                "Unable to initialize backend")


@pytest.mark.slow
def test_train_py_on_cpu_starts_clean_and_reruns_from_the_compilation_cache(tmp_path):
    """`python train.py --config=configs/tiny.py` as a user runs it (no JAX_PLATFORMS, libtpu installed with the test
    extra, no TPU attached): no libtpu initialisation line in its output. The per-user compilation cache is on by
    default: the first run writes it, a rerun of the same stage in a new workdir adds no entry (it compiled
    nothing), and reads its train step and initialiser from the program cache inside it (glmjax/train/programs.py:
    neither traced nor lowered) with the same losses. Off (`--compilation_cache=`, i.e. `configure_jax("")`): a process that compiles writes nothing, also with
    GLMJAX_CACHE_DIR set (a refused resume of train.py would not do: it now stops before anything compiles)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["GLMJAX_CACHE_DIR"] = cache = str(tmp_path / "cache")
    flags = ["--config=configs/tiny.py", "--config.train.steps=2", "--config.train.seq_len=32",
             "--config.train.batch_size=2", "--config.train.eval_batches=0", "--config.data.max_docs=20",
             "--config.optim.warmup_steps=1", "--config.model.num_nextn_predict_layers=0",  # less to compile: no MTP,
             "--config.model.num_hidden_layers=2", "--config.model.indexer_types=('full', 'shared')"]  # 2 layers

    def train(name, log_compiles=False):
        p = subprocess.run([sys.executable, "train.py", *flags, f"--workdir={tmp_path / name}"], cwd=ROOT,
                           env={**env, "JAX_LOG_COMPILES": str(int(log_compiles))}, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout + p.stderr

    def losses(name):
        with open(tmp_path / name / "metrics.jsonl") as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r]

    def entries():
        return set(os.listdir(cache)) if os.path.isdir(cache) else set()

    out = train("cold")
    assert not [line for line in out.splitlines() if any(n in line for n in LIBTPU_NOISE)], out[-3000:]
    cold = entries()
    assert len(cold) > 5, cold  # the train step, the evaluation of the state, model set-up's small programs
    assert len(os.listdir(os.path.join(cache, "programs"))) == 2  # the train step and the initialiser
    log = train("warm", log_compiles=True)
    assert entries() == cold  # every program of the rerun came from the cache
    assert "Finished tracing train_step" not in log and "conversion jit(init)" not in log, log[-3000:]
    assert "Finished tracing" in log  # the control: the log is on (the rerun still traces small programs)
    assert losses("warm") == losses("cold") and len(losses("cold")) == 2
    for arg, written in (("''", False), ("None", True)):  # off; then the control: the same process with it on
        env["GLMJAX_CACHE_DIR"] = other = str(tmp_path / f"other_{written}")
        p = subprocess.run([sys.executable, "-c", "import jax; from glmjax.cli.runtime import configure_jax; "
                            f"print(configure_jax({arg})); jax.jit(lambda v: v * 3 + 1)(1.0).block_until_ready()"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        assert bool(os.path.isdir(other) and os.listdir(other)) == written, p.stdout
