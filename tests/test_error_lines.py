"""Errors end in one named line (issue 46): a config file that does not load, evaluation without held-out
documents, a half-written checkpoint or one holding only orbax's temporary directory, a truncated safetensors file
-- under train.py's init_from, glmjax-generate, glmjax-hf inspect / import / export. Exit status 2 for config and
data, 3 for checkpoints; no traceback, no "Event loop is closed" report."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from glmjax.cli import generate as gen_cli
from glmjax.cli import hf as hf_cli
from glmjax.interop import save_hf
from glmjax.model import GLM
from glmjax.train.checkpoint import Checkpoints
from helpers import tiny
from test_reliability import FLAGS, ROOT
from xla_flags import xla_flags


def train_py(*argv, program=("train.py",), cache="--compilation_cache="):
    """train.py (or another program) in a process of its own -> (exit status, stderr)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    p = subprocess.run([sys.executable, *program, *argv, cache], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stderr


def one_line(err: str, start: str) -> str:
    lines = [x for x in err.strip().splitlines() if x and not x.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith(start), err[-3000:]
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    return lines[0]


def test_a_config_file_that_does_not_load_is_one_line(tmp_path):
    rc, err = train_py("--config=configs/tiy.py", f"--workdir={tmp_path / 'a'}")
    assert rc == 2 and "No such file or directory" in one_line(err, "flag error: --config=configs/tiy.py: ")
    raising = tmp_path / "raising.py"
    for body, cause in (("return 1 / 0", "ZeroDivisionError: division by zero"),
                        ("raise ValueError('no such size')", "ValueError: no such size")):  # absl wraps a ValueError
        raising.write_text(f"def get_config():\n    {body}\n")
        rc, err = train_py(f"--config={raising}", f"--workdir={tmp_path / 'b'}")
        assert rc == 2 and one_line(err, f"flag error: --config={raising}: ").endswith(
            f"the config file does not load ({cause})")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """{kind: directory}: a stage workdir whose only step lost its manifest and its array data (half-written), one
    holding only an orbax temporary directory, and a Hugging Face checkpoint truncated to a third."""
    root = tmp_path_factory.mktemp("damaged")
    model = GLM(tiny(num_nextn_predict_layers=0), nnx.Rngs(0))
    half = str(root / "half")
    ck = Checkpoints(half, async_save=False)
    ck.save(2, nnx.state(model).to_pure_dict(), {"count": np.zeros((), np.int32)}, {},
            {"model": model.cfg.to_json_dict(), "stage": "pretrain"})
    ck.close()
    tmp_only = str(root / "tmp_only")
    os.makedirs(os.path.join(tmp_only, "checkpoints"))
    shutil.copytree(os.path.join(half, "checkpoints", "2"),
                    os.path.join(tmp_only, "checkpoints", "2.orbax-checkpoint-tmp-1733"))
    step = os.path.join(half, "checkpoints", "2")
    os.remove(os.path.join(step, "manifest.json"))
    shutil.rmtree(os.path.join(step, "model", "d"))  # the arrays' chunks: never written
    hf = str(root / "hf")
    save_hf(model, hf, None, dtype="F32")
    shard = [os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors")][0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 3)
    return {"half": half, "tmp_only": tmp_only, "hf": hf}


@pytest.mark.parametrize("kind", ["half", "tmp_only", "hf"])
def test_a_damaged_checkpoint_is_one_line_and_exit_3_in_generate_and_hf(damaged, kind, tmp_path, capsys):
    if kind == "half":  # in a process of its own: orbax's reports of the failed read would reach its stderr
        rc, err = train_py("--checkpoint", damaged[kind], "--prompt", "x", program=("-m", "glmjax.cli.generate"),
                           cache="--compilation-cache=")
        assert rc == 3 and "no intact checkpoint" in one_line(err, "checkpoint error: ")
    assert gen_cli.main(["--checkpoint", damaged[kind], "--prompt", "x", "--compilation-cache", ""]) == 3
    one_line(capsys.readouterr().err, "checkpoint error: ")
    if kind == "hf":
        for argv in (["inspect", damaged[kind]], ["import", damaged[kind], str(tmp_path / "imported")]):
            assert hf_cli.main(argv + ["--compilation-cache", ""]) == 3
            assert "bad data_offsets" in one_line(capsys.readouterr().err, "checkpoint error: ")
    else:
        assert hf_cli.main(["export", damaged[kind], str(tmp_path / "out"), "--compilation-cache", ""]) == 3
        assert "no intact checkpoint" in one_line(capsys.readouterr().err, "checkpoint error: ")
        assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_train_py_init_from_a_damaged_checkpoint_and_eval_without_held_out_data(damaged, tmp_path):
    """The init_from errors come after set-up, whose train step compiles meanwhile (and is waited for): the
    reference run's flags and the tests' compilation cache, so that it is one program compiled once (and no
    more than once here), not three cold compiles."""
    common, cache = FLAGS, f"--compilation_cache={os.environ.get('GLMJAX_CACHE_DIR', '')}"
    for kind in ("half", "tmp_only", "hf"):
        rc, err = train_py(*common, f"--config.init_from={damaged[kind]}", f"--workdir={tmp_path / kind}",
                           cache=cache)
        assert rc == 3, err[-3000:]
        one_line(err, "checkpoint error: ")
    rc, err = train_py(*common, "--config.train.eval_batches=2", "--config.data.eval_fraction=0.0",
                       f"--workdir={tmp_path / 'eval'}")
    assert rc == 2 and one_line(err, "config error: data.eval_fraction=0.0: no held-out documents")
