"""glmjax/resolve.py, the one resolver of a checkpoint directory (issue 45): every kind -- a stage workdir, an import
with its hf_layout.json, a PPO run's policy/ found from its workdir, a Hugging Face checkpoint -- reads back the
weights that were saved, onto the first device or, by a placement rule, straight onto an 8-device mesh (each tensor
where the target model holds its own); any other directory is one line naming the option that gave it."""
import json
import os

import numpy as np
import pytest
from flax import nnx, traverse_util

from glmjax import parallel as par
from glmjax.cli import hf as hf_cli
from glmjax.interop import check_hf, save_hf
from glmjax.model import GLM
from glmjax.resolve import load, load_model, locate, write_import
from glmjax.train.checkpoint import Checkpoints
from glmjax.train.init_from import placed_like
from helpers import tiny


def flat(state) -> dict:
    """{key path as a tuple of str: leaf} (orbax restores a list index as a str key)."""
    return {tuple(map(str, k)): x for k, x in traverse_util.flatten_dict(state).items()}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """-> (model, {kind: the directory given}, the config a Hugging Face import reads): one tiny model saved as every
    kind."""
    root = tmp_path_factory.mktemp("kinds")
    model = GLM(tiny(), nnx.Rngs(5))
    work = str(root / "stage")
    ck = Checkpoints(work, async_save=False)
    ck.save(3, nnx.state(model).to_pure_dict(), {"count": np.zeros((), np.int32)}, {},
            {"model": model.cfg.to_json_dict(), "stage": "sft"})  # as the loop saves
    ck.close()
    with open(os.path.join(work, "config.json"), "w") as f:  # a stage workdir also holds the run's config.json
        json.dump({"model": model.cfg.to_json_dict(), "train": {}}, f)
    hf = str(root / "hf")
    save_hf(model, hf, None, dtype="F32")
    imported = str(root / "imported")
    assert hf_cli.main(["import", hf, imported, "--compilation-cache", ""]) == 0
    ppo = str(root / "ppo")  # a finished PPO workdir whose checkpoints/ were removed: its policy/ remains
    write_import(os.path.join(ppo, "policy"), nnx.state(model), model.cfg)
    return model, {"workdir": work, "import": imported, "policy": ppo, "hf": hf}, check_hf(hf)[0]


@pytest.mark.parametrize("kind", ["workdir", "import", "policy", "hf"])
def test_every_kind_loads_the_saved_weights(kinds, kind):
    model, paths, hf_cfg = kinds
    src = locate(paths[kind])
    assert src.kind == {"policy": "import"}.get(kind, kind)
    assert src.path == (os.path.join(paths[kind], "policy") if kind == "policy" else paths[kind])
    got, loaded = load_model(paths[kind])
    assert loaded.cfg == (hf_cfg if kind in ("import", "hf") else model.cfg)
    assert (loaded.layout is not None) == (kind == "import")
    want, back = flat(nnx.state(model).to_pure_dict()), flat(nnx.state(got).to_pure_dict())
    assert back.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(want[k]), err_msg=str(k))


@pytest.mark.parametrize("kind", ["workdir", "import", "hf"])
def test_each_tensor_is_read_into_the_target_placement(kinds, kind):
    """A checkpoint written on one device, read for a model on an fsdp 4 x tensor 2 mesh: each tensor arrives in
    that model's sharding, with the saved values."""
    model, paths, _ = kinds
    mesh = par.make_mesh(dict(data=1, fsdp=4, tensor=2))
    graphdef, state = par.create_sharded(lambda: GLM(model.cfg, nnx.Rngs(0)), mesh)
    target = nnx.merge(graphdef, state)
    loaded = load(paths[kind], sharding=placed_like(target))
    want, back = flat(nnx.state(target).to_pure_dict()), flat(loaded.state)
    saved = flat(nnx.state(model).to_pure_dict())
    split = 0
    for k, x in back.items():
        assert x.sharding == want[k].sharding, k
        split += len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(x), np.asarray(saved[k]), err_msg=str(k))
    assert split > 10  # the rule placed them, not a replicated default


def test_anything_else_is_one_line_naming_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "run").mkdir()  # a training workdir before its first checkpoint: only the run's config.json
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": {}, "train": {}}))
    cases = {str(tmp_path / "missing"): "no such directory", str(tmp_path / "empty"): "neither a stage or PPO workdir",
             str(tmp_path / "run"): "not a Hugging Face config (no model_type)"}
    for path, reason in cases.items():
        with pytest.raises(FileNotFoundError) as e:
            locate(path, "--checkpoint")
        assert str(e.value).startswith(f"--checkpoint={path!r}: ") and reason in str(e.value) \
            and "\n" not in str(e.value)
