"""Resuming never loses or silently discards a run (issue 17): a checkpoint is set aside only when proven damaged
(checksum mismatch or read error), a changed config stops with the changed fields, all-damaged stops, and bad
flags / data / workdirs end in one named line and a non-zero exit. References: the files and checksums of the
checkpoints before the command (nothing moved or changed), and the losses of an uninterrupted run."""
import json
import os
import shutil
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest

from glmjax.train.checkpoint import CheckpointError, Checkpoints, newest_meta

from test_reliability import FLAGS, ROOT, flip, losses
from xla_flags import xla_flags

STEPS = 10  # the shared reference run (conftest.py): checkpoints at 2, 4, ..., 10


def train(workdir, *extra, devices=1, timeout=600):
    cache = os.environ.get("GLMJAX_TEST_CACHE", os.path.join("/tmp", "glmjax_jax_cache"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    p = subprocess.run([sys.executable, "train.py", *FLAGS, *extra, f"--workdir={workdir}",
                        f"--compilation_cache={cache}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def snapshot(workdir):
    """{relative path: crc32} of every file under workdir/checkpoints."""
    out = {}
    root = os.path.join(workdir, "checkpoints")
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root)] = zlib.crc32(open(path, "rb").read())
    return out


@pytest.fixture
def interrupted(reference, tmp_path):
    """A copy of the reference run that has not written summary.json (as if killed after its last checkpoint)."""
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    os.remove(os.path.join(workdir, "summary.json"))
    return workdir


def largest_file(step_dir, under="model"):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, under)) for f in fs]
    return max(files, key=os.path.getsize)


def one_line_error(rc, out, code, *names):
    assert rc == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for name in names:
        assert name in out, (name, out[-3000:])


# ------------------------------------------------------------------------ 1. a changed config stops, moves nothing


@pytest.mark.slow
def test_changed_config_stops_and_moves_nothing(interrupted):
    """Three changed fields of three sections (optimizer, model shape, batch) in one launch: the refusal names every
    one of them (the check diffs all fingerprinted fields, so each is detected on its own)."""
    before, config = snapshot(interrupted), open(os.path.join(interrupted, "config.json")).read()
    rc, out = train(interrupted, "--config.optim.name=muon", "--config.model.intermediate_size=128",
                    "--config.train.batch_size=4")
    one_line_error(rc, out, 2, "3 field(s)", "optim.name", "model.intermediate_size", "train.batch_size",
                   "on_config_change=fresh", "new --workdir")
    assert "data:" not in out and "attention" not in out, out  # refused before the data and the model are built
    assert snapshot(interrupted) == before
    assert open(os.path.join(interrupted, "config.json")).read() == config
    assert not os.path.exists(os.path.join(interrupted, "corrupt_checkpoints"))


@pytest.mark.slow
def test_finished_stage_with_changed_config_stops(reference, tmp_path):
    finished = str(tmp_path / "run")
    shutil.copytree(reference, finished)
    before = snapshot(finished)
    rc, out = train(finished, "--config.optim.lr=0.001")
    one_line_error(rc, out, 2, "optim.lr", "on_config_change")
    assert snapshot(finished) == before


@pytest.mark.slow
def test_on_config_change_weights_archives_the_old_run_and_starts_from_its_weights(interrupted):
    # the change: the data (a fingerprinted field that is not in the compiled step, so the reference's step serves)
    before = snapshot(interrupted)
    rc, out = train(interrupted, "--config.data.max_docs=49", "--config.train.on_config_change=weights")
    assert rc == 0, out[-3000:]
    (archived,) = os.listdir(os.path.join(interrupted, "archive"))
    old = os.path.join(interrupted, "archive", archived)
    assert snapshot(old) == before  # the old run, intact
    assert f"init_from {old}: stage pretrain, step {STEPS}" in out
    assert sorted(losses(interrupted)) == list(range(1, STEPS + 1))  # a new run from step 1
    rc, out = train(interrupted, "--config.data.max_docs=49", "--config.train.on_config_change=weights")
    assert rc == 0 and "already complete" in out  # rerunning the same command does not start over again


# ------------------------------------------------------------------------ 2. + 3. damage, checksums


@pytest.mark.slow
def test_all_checkpoints_damaged_is_an_error_and_nothing_is_moved(interrupted):
    for step in range(2, STEPS + 1, 2):
        flip(largest_file(os.path.join(interrupted, "checkpoints", str(step))), 1)
    before = snapshot(interrupted)
    rc, out = train(interrupted)
    one_line_error(rc, out, 3, "all 5 checkpoints", "checksum", "step 2", "step 6", f"step {STEPS}")
    assert snapshot(interrupted) == before
    assert not os.path.exists(os.path.join(interrupted, "corrupt_checkpoints"))


def small_run(tmp_path, steps=(1, 2)):
    ck = Checkpoints(str(tmp_path), keep=5, async_save=True)
    for s in steps:
        ck.save(s, {"w": np.full((64, 64), s, np.float32)}, {"m": np.zeros(8, np.float32)},
                {"processes": [{"slots": [[s, 0, 1]]}]}, {"step": s, "fingerprint": {"optim.lr": 1.0}})
    ck.close()
    return Checkpoints(str(tmp_path), keep=5)


TEMPLATE = ({"w": np.zeros((64, 64), np.float32)}, {"m": np.zeros(8, np.float32)})


@pytest.mark.parametrize("damage", ["data", "model"])
def test_a_changed_file_fails_its_checksum_and_names_the_file(tmp_path, damage):
    ck = small_run(tmp_path)
    step_dir = ck.step_dir(2)
    assert os.path.exists(os.path.join(step_dir, "manifest.json"))
    if damage == "data":  # an edited data-iterator state: still valid JSON, one number changed
        path = os.path.join(step_dir, "data", "metadata")
        text = open(path).read()
        assert '"slots": [[2, 0, 1]]' in text
        open(path, "w").write(text.replace('"slots": [[2, 0, 1]]', '"slots": [[3, 0, 1]]'))
        name = "data/metadata"
    else:
        path = largest_file(step_dir)
        flip(path)
        name = os.path.relpath(path, step_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, model, _, data, _ = ck.restore_latest(*TEMPLATE)
    ck.close()
    assert step == 1 and np.all(np.asarray(model["w"]) == 1) and data["processes"][0]["slots"] == [[1, 0, 1]]
    assert any(f"file {name} fails its checksum" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    assert len(os.listdir(tmp_path / "corrupt_checkpoints")) == 1


def test_newest_meta_reads_no_array_and_skips_a_meta_that_fails_its_checksum(tmp_path):
    """train.py's early refusal of a changed config reads only the metas: the newest one whose files match the
    manifest; a damaged model file does not matter to it (the restore deals with that)."""
    small_run(tmp_path).close()
    assert newest_meta(str(tmp_path))[0] == 2
    flip(largest_file(os.path.join(tmp_path, "checkpoints", "2")), 1)  # the model file
    assert newest_meta(str(tmp_path))[0] == 2
    path = os.path.join(tmp_path, "checkpoints", "2", "meta", "metadata")
    text = open(path).read()
    assert '"step": 2' in text
    open(path, "w").write(text.replace('"step": 2', '"step": 7'))  # valid JSON, not the bytes the manifest has
    step, meta = newest_meta(str(tmp_path))
    assert step == 1 and meta["step"] == 1


def test_refused_meta_propagates_and_all_damaged_moves_nothing(tmp_path):
    ck = small_run(tmp_path)

    def refuse(meta, step):
        raise ValueError(f"different config at {step}")

    with pytest.raises(ValueError, match="different config at 2"):
        ck.restore_latest(*TEMPLATE, check_meta=refuse)
    for s in (1, 2):
        flip(largest_file(ck.step_dir(s)), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="all 2 checkpoints"):
            ck.restore_latest(*TEMPLATE)
    ck.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
    assert not os.path.exists(tmp_path / "corrupt_checkpoints")


# ------------------------------------------------------------------------ 6. flags


FLAG_CASES = [
    (["--config.train.stepz=5"], "stepz", 'Did you mean "steps"'),
    (["--config.stages.pretrain.train.steps=2"], "stages.pretrain", "no field 'pretrain'"),
    (["--config.train.seed=-1"], "train.seed=-1", "2**32"),
    (["--config.init_from=/tmp"], "init_from='/tmp'", "neither a stage or PPO workdir"),
    (["--config.train.batch_size=3"], "train.batch_size=3", "batch shards"),
    (["--config.train.seq_len=1"], "train.seq_len=1", ">= 2"),
    (["--config.model.mtp_depth=500"], "mtp_depth=500", "seq_len"),
    (["--config.model.index_topk=1000"], "model.index_topk=1000", "train.seq_len=32"),
    (["--config.train.bias_update_rate=nan"], "train.bias_update_rate=nan", "finite"),
    (["--config.train.index_loss_weight=inf"], "train.index_loss_weight=inf", "finite"),
    (["--config.model.rope_theta=inf"], "model.rope_theta=inf", "finite"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags,culprit,rule", FLAG_CASES, ids=[c[1] for c in FLAG_CASES])
def test_bad_flags_end_in_one_named_line(tmp_path, flags, culprit, rule):
    rc, out = train(str(tmp_path / "run"), *flags, devices=2)
    one_line_error(rc, out, 2, culprit, rule)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


# ------------------------------------------------------------------------ 7. summary.json after any clean stop


@pytest.mark.slow
def test_resumed_at_the_end_writes_a_complete_summary(interrupted):
    rc, out = train(interrupted, "--config.train.eval_batches=1")
    assert rc == 0, out[-3000:]
    summary = json.load(open(os.path.join(interrupted, "summary.json")))  # strict JSON: no NaN
    assert summary["step"] == STEPS and summary["last_loss"] == losses(interrupted)[STEPS]
    assert np.isfinite(summary["eval_loss"]) and summary["tokens_per_s"] is None


# ------------------------------------------------------------------------ 4. + 5. bad data, bad workdirs


def jsonl(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def good_lines(n):
    return [json.dumps({"text": f"document {i}: " + "words and more words " * 20}) for i in range(n)]


@pytest.mark.slow
def test_malformed_lines_are_skipped_once_and_never_empty_the_eval_set(tmp_path):
    from glmjax.data import default_data_config, make_pipeline
    from glmjax.data.pipeline import split_indices
    from glmjax.data.sources import open_source

    lines = good_lines(40)
    path = str(tmp_path / "d.jsonl")
    jsonl(path, lines)
    held = split_indices(open_source(path).key_hashes(), 0.02, "eval")
    assert len(held) == 1
    for i in list(held) + [5, 9]:
        lines[i] = '{"text": broken'  # the one eval record and two train records are malformed
    jsonl(path, lines)
    cfg = default_data_config(path=path)
    ev = make_pipeline(cfg, 32, 2, 0, "eval")
    tr = make_pipeline(cfg, 32, 2, 0, "train")
    assert not set(ev.indices) & set(tr.indices) and len(ev.indices) + len(tr.indices) == 40
    assert ev.take(1)[0]["loss_mask"].sum() > 0
    for _ in range(400):  # many epochs over 38-ish train documents
        next(tr)
    assert tr.stats["skipped_malformed"] == len(held) + 2 - sum(i in ev.indices for i in list(held) + [5, 9])
    tr.close()


BAD_FILES = {
    "parquet_without_text": ("d.parquet", "has no column(s) ['text']"),
    "empty_file": ("d.jsonl", "no train documents"),
    "binary_file": ("d.bin", "is usable"),
    "truncated_parquet": ("d.parquet", "cannot be read as parquet"),
    "dangling_symlink": ("link.jsonl", "dangling symlink"),
}


def make_bad(kind, directory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = BAD_FILES[kind][0]
    path = os.path.join(directory, name)
    if kind in ("parquet_without_text", "truncated_parquet"):
        col = "body" if kind == "parquet_without_text" else "text"
        pq.write_table(pa.table({col: [f"doc {i} " * 50 for i in range(20)]}), path)
        if kind == "truncated_parquet":
            data = open(path, "rb").read()
            open(path, "wb").write(data[:len(data) // 2])
    elif kind == "empty_file":
        open(path, "w").close()
    elif kind == "binary_file":
        open(path, "wb").write(bytes(range(256)) * 40 + b"\xff\xfe" * 100)
    else:
        os.symlink(os.path.join(directory, "gone.jsonl"), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_data_files_end_in_one_named_line(tmp_path, kind):
    data = tmp_path / "data"
    data.mkdir()
    if kind == "dangling_symlink":
        jsonl(str(data / "good.jsonl"), good_lines(20))
    path = make_bad(kind, str(data))
    rc, out = train(str(tmp_path / "run"), f"--config.data.path={data}")
    one_line_error(rc, out, 2, "data error", os.path.basename(path), BAD_FILES[kind][1])
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["under_proc", "a_file", "read_only_mount"])
def test_unusable_workdir_ends_in_one_named_line(tmp_path, kind):
    workdir = "/proc/glmjax_run" if kind == "under_proc" else str(tmp_path / "file")
    if kind == "a_file":
        open(workdir, "w").close()
    mount = tmp_path / "ro"
    if kind == "read_only_mount":
        mount.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs (needs root): {(p.stderr or p.stdout).strip()}")
        workdir = str(mount / "run")
    try:
        rc, out = train(workdir)
    finally:
        if kind == "read_only_mount":
            subprocess.run(["umount", "-l", str(mount)], check=False)
    one_line_error(rc, out, 2, f"workdir={workdir!r}")


# ------------------------------------------------------------------------ fault injection, disk full, log hygiene


@pytest.fixture
def tmpfs(tmp_path):
    """A 20 MiB tmpfs: one checkpoint of the 2-layer tiny run (~14 MiB: model + Adam state) fits, a second does not."""
    path = tmp_path / "small_disk"
    path.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {(p.stderr or p.stdout).strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
def test_disk_full_stops_in_one_line_and_keeps_the_last_checkpoint(tmpfs):
    from glmjax.train.checkpoint import load_model_state, verify_manifest

    workdir = os.path.join(tmpfs, "run")
    rc, out = train(workdir)
    lines = [line for line in out.splitlines() if line.strip()]
    assert rc == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert len(lines) <= 30, f"{len(lines)} lines:\n" + out[-3000:]
    named = [line for line in lines if "no space left" in line.lower()]
    assert len(named) == 1 and named[0].startswith("stopped: no space left on the device"), out[-3000:]
    assert "the last intact checkpoint is step 2" in named[0], named
    assert verify_manifest(os.path.join(workdir, "checkpoints", "2")) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, meta, step = load_model_state(workdir)
    assert step == 2 and meta["step"] == 2 and state
    assert not [w for w in caught if "checkpoint" in str(w.message)], [str(w.message) for w in caught]


def test_a_fingerprint_without_default_model_fields_still_matches():
    """Workdirs written before configs carried every model field: an absent model field is its default, so they
    resume; a field that really differs from the default is still a difference."""
    from configs import tiny
    from glmjax.train.resume import config_diff, fingerprint

    now = fingerprint(tiny.get_config())
    old = {k: v for k, v in now.items() if k not in ("model.routed_scaling_factor", "model.rope_scaling",
                                                     "model.remat", "model.init_std")}
    assert config_diff(old, now) == [] and config_diff(now, old) == []
    changed = dict(now, **{"model.routed_scaling_factor": 1.0})
    assert config_diff(old, changed) == ["model.routed_scaling_factor: 2.5 -> 1.0"]


def test_a_ppo_field_added_since_the_checkpoint_counts_as_its_default():
    """A PPO run checkpointed before ppo.context_budget existed resumes (the field at its default); set otherwise,
    it is a changed config."""
    from glmjax.rl.ppo import PPO_DEFAULTS
    from glmjax.train.resume import config_diff

    saved = {"ppo.steps": 3}
    assert config_diff(saved, {"ppo.steps": 3, "ppo.context_budget": 0}, PPO_DEFAULTS) == []
    assert config_diff(saved, {"ppo.steps": 3, "ppo.context_budget": 8}, PPO_DEFAULTS) == ["ppo.context_budget: 0 -> 8"]
    assert config_diff(saved, {"ppo.steps": 3, "ppo.context_budget": 0}) == ["ppo.context_budget: '<absent>' -> 0"]
