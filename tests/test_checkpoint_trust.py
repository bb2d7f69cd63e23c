"""No checkpoint is trusted unverified (issue 46): a step whose run was killed between orbax's commit and its
manifest (marked unsealed by its writer) never counts, its bytes flipped or not: readers skip it, the next run sets
it aside (and writes the step again). A step whose restored weights or optimizer state hold a NaN is damaged; the
run resumes from the step before, and with nothing left it is a CheckpointError (train.py: exit 3) naming each
step's problem."""
import os
import warnings

import numpy as np
import pytest

from glmjax.train.checkpoint import CheckpointError, Checkpoints
from glmjax.workdir import MANIFEST, load_model_state, unsealed_marker
from test_reliability import flip


def state(step: int, nan: bool = False) -> tuple[dict, dict]:
    w = np.full((64, 64), float(step), np.float32)
    if nan:
        w[3, 5] = np.nan
    return {"layer": {"w": w}, "b": np.arange(8, dtype=np.float32)}, {"m": np.zeros((64, 64), np.float32)}


def write(workdir, steps, nan_at=()):
    ck = Checkpoints(workdir, keep=10, async_save=False)
    for s in steps:
        model, opt = state(s, nan=s in nan_at)
        ck.save(s, model, opt, {"position": s}, {"step": s, "model": {}})
    ck.close()


def restore(workdir):
    model, opt = state(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = Checkpoints(workdir, keep=10)  # a writer: it sets aside the steps that never counted
        try:
            got = ck.restore_latest(model, opt)
        finally:
            ck.close()
    return got, [str(w.message) for w in caught]


def test_a_step_killed_before_its_seal_is_never_trusted(tmp_path):
    workdir = str(tmp_path)
    write(workdir, [2, 4, 6])
    assert not os.path.exists(os.path.join(workdir, ".unsealed"))  # every step sealed: no mark left
    step6 = os.path.join(workdir, "checkpoints", "6")
    os.remove(os.path.join(step6, MANIFEST))  # the state a kill -9 after orbax's commit leaves
    os.makedirs(os.path.dirname(unsealed_marker(step6)))
    open(unsealed_marker(step6), "w").close()
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step6, "model")) for f in fs]
    flip(max(files, key=os.path.getsize))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, meta, step = load_model_state(workdir)
    assert step == 4 and any("checkpoints/6 is damaged and was skipped: never sealed" in str(w.message)
                             for w in caught)
    (step, model, _, data, _), said = restore(workdir)
    assert step == 4 and data == {"position": 4} and float(model["layer"]["w"][0, 0]) == 4.0
    assert [m for m in said if "checkpoints/6 was never sealed" in m], said
    assert os.listdir(os.path.join(workdir, "corrupt_checkpoints"))  # set aside: the run writes step 6 again
    assert not os.path.exists(os.path.dirname(unsealed_marker(step6)))


def test_a_step_without_a_manifest_or_a_mark_is_read_with_a_warning(tmp_path):
    """What a glmjax from before manifests wrote: the only case read unverified."""
    workdir = str(tmp_path)
    write(workdir, [2])
    os.remove(os.path.join(workdir, "checkpoints", "2", MANIFEST))
    (step, *_), said = restore(workdir)
    assert step == 2 and [m for m in said if "read without checksum verification" in m], said


def test_non_finite_weights_are_damage_naming_the_tensor(tmp_path):
    workdir = str(tmp_path)
    write(workdir, [2, 4], nan_at=(4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_model_state(workdir)[2] == 2
    assert any("checkpoints/4 is damaged and was skipped: tensor layer/w holds non-finite values" in str(w.message)
               for w in caught)
    (step, *_), said = restore(workdir)
    assert step == 2 and [m for m in said if "checkpoints/4 is damaged: tensor model/layer/w holds non-finite" in m]

    only = str(tmp_path / "only")
    write(only, [2], nan_at=(2,))
    with pytest.raises(CheckpointError, match="step 2: tensor model/layer/w holds non-finite values"):
        restore(only)
