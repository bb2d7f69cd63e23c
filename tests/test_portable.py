"""Checkpoints move between machines (issue 45): a run trained on 8 devices (every weight split over fsdp x tensor)
is sampled, exported and trained from (init_from) by processes that have one device, as a laptop would; the greedy
ids equal generating from the same workdir on the 8-device mesh, the export holds the run's weights, and init_from
keeps every tensor."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from glmjax import parallel as par
from glmjax.data.tokenizer import make_tokenizer
from glmjax.infer import Decoder, generate
from glmjax.resolve import load_model
from test_reliability import ROOT
from test_resume import train
from xla_flags import xla_flags

PROMPT = "def parse(self"


def one_device(*argv):
    """A glmjax command in a process that sees one CPU device -> (exit code, stdout, stderr)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    p = subprocess.run([sys.executable, "-m", *argv, "--compilation-cache", ""], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.slow
def test_a_run_on_8_devices_generates_and_exports_on_one(tmp_path):
    run = str(tmp_path / "run")
    rc, out = train(run, "--config.train.steps=4", "--config.train.batch_size=8", "--config.parallel.data=1",
                    "--config.parallel.fsdp=4", "--config.parallel.tensor=2", devices=8)
    assert rc == 0, out[-3000:]
    with open(os.path.join(run, "checkpoints", "4", "model", "_sharding")) as f:  # saved split over 8 devices
        assert '[1, 4, 1, 1, 2]' in f.read().replace('\\"', '"')  # the mesh shape (data fsdp expert context tensor)

    rc, stdout, stderr = one_device("glmjax.cli.generate", "--checkpoint", run, "--prompt", PROMPT,
                                    "--max-new-tokens", "12", "--ids")
    assert rc == 0, stderr[-3000:]
    got = json.loads(stdout.splitlines()[-1])

    model = load_model(run)[0]
    mesh = par.make_mesh(dict(data=1, fsdp=4, tensor=2))
    tok = make_tokenizer("byte")
    want = generate(Decoder(model, "sparse", mesh=mesh), [tok.encode(PROMPT, bos=True, eos=False).tolist()], 12,
                    key=jax.random.key(0), stop_tokens=[tok.eos_id], pad_id=tok.pad_id)
    assert got == want.tokens[0, :want.lengths[0]].tolist() and len(got) == 12

    out_dir = str(tmp_path / "hf")
    rc, _, stderr = one_device("glmjax.cli.hf", "export", run, out_dir)
    assert rc == 0, stderr[-3000:]
    from flax import nnx, traverse_util
    from glmjax.interop import load_hf

    back, ours = (traverse_util.flatten_dict(nnx.state(m, nnx.Param).to_pure_dict())
                  for m in (load_hf(out_dir)[0], model))
    assert back.keys() == ours.keys()
    for k in ours:  # the run's weights (the export's dtype: bf16)
        np.testing.assert_allclose(np.asarray(back[k], np.float32), np.asarray(ours[k], np.float32), rtol=1e-2,
                                   atol=1e-6, err_msg=str(k))

    rc, out = train(str(tmp_path / "next"), f"--config.init_from={run}", "--config.train.steps=3", devices=1)
    assert rc == 0 and "fresh (not in the checkpoint): none" in out and "dropped (not in this model): none" in out, \
        out[-3000:]
