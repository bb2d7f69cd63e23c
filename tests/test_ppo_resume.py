"""The PPO stage survives what a training stage survives (train.py, configs/ppo_tiny.py made small, synchronous
rollouts): kill -9 at random moments resumes with bitwise the same losses and rewards (bench/fault_injection.py
--stage ppo), SIGTERM checkpoints and exits 0, a changed config is refused in one line with metrics.jsonl kept, a
finished run is not rerun, and glmjax-generate / glmjax-hf export read a PPO workdir's policy."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.fault_injection import PPO_FLAGS, records  # noqa: E402
from test_reliability import fault_injection, flip, launch as train_launch  # noqa: E402

STEPS, EVERY = 4, 1  # a checkpoint after every step: kills land between checkpoints of a run that is training
FLAGS = PPO_FLAGS + [f"--config.ppo.steps={STEPS}", f"--config.ppo.checkpoint_every={EVERY}",
                     "--config.ppo.keep_checkpoints=10"]


def launch(workdir, *extra):
    """train.py on this module's PPO run (stdout and stderr apart: the refusals' one line is stderr's)."""
    return train_launch(workdir, *extra, flags=FLAGS, stderr=subprocess.PIPE)


def finish(p, timeout=300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def wait_for_step(p, workdir, step, timeout=300):
    """Until the run has logged step `step`'s record."""
    t0 = time.time()
    while max(step_records(workdir), default=0) < step:
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def step_records(workdir) -> dict:
    """step -> that step's last record (all values but the timings, as JSON; a resumed run re-logs the steps after
    its checkpoint)."""
    return dict(records(workdir)[0])


def interrupted(reference, target, last=2):
    """A copy of the reference run as if killed after step `last`'s checkpoint: its later checkpoints, policy/ and
    summary.json gone, metrics.jsonl cut after that step."""
    shutil.copytree(reference, target)
    os.remove(os.path.join(target, "summary.json"))
    shutil.rmtree(os.path.join(target, "policy"))
    for step in os.listdir(os.path.join(target, "checkpoints")):
        if int(step) > last:
            shutil.rmtree(os.path.join(target, "checkpoints", step))
    lines = open(os.path.join(target, "metrics.jsonl")).readlines()
    keep = [line for line in lines if json.loads(line)["step"] <= last]
    with open(os.path.join(target, "metrics.jsonl"), "w") as f:
        f.writelines(keep)
    return target


def test_reference_run_is_complete_and_learns(ppo_reference):
    """The run the others compare with: every step logged and checkpointed, rewards and actor gradients not all 0
    (a run with nothing to learn would resume "bitwise" with a broken optimizer state)."""
    recs = {s: json.loads(r) for s, r in step_records(ppo_reference).items()}
    assert sorted(recs) == list(range(1, STEPS + 1))
    assert any(r["reward_mean"] > 0 for r in recs.values()) and any(r.get("actor_grad_norm", 0) > 0
                                                                     for r in recs.values()), recs
    assert sorted(int(s) for s in os.listdir(os.path.join(ppo_reference, "checkpoints"))) == list(range(1, STEPS + 1))
    summary = json.load(open(os.path.join(ppo_reference, "summary.json")))
    assert summary["start_step"] == 0 and summary["final_version"] == STEPS - 1  # one critic warm-up step
    assert os.path.exists(os.path.join(ppo_reference, "policy", "model_config.json"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fault_injection_kill9_resume_bitwise(ppo_reference, tmp_path):
    """A kill -9 at a seeded random moment (mid-step, mid-checkpoint-write or mid-eval), the same command resumed to
    the end: every step record (losses, rewards, KL, advantages, lr multiplier...) bitwise the uninterrupted run's.
    The documented run with 8 kills, 1-3 per workdir, is in docs/benchmarks.md."""
    fault_injection(ppo_reference, tmp_path, 1, "all losses and rewards bitwise identical", "--stage", "ppo",
                    "--seed", "0", "--max-kills-per-workdir", "1", f"--steps={STEPS}", f"--checkpoint-every={EVERY}")


@pytest.mark.slow
def test_sigterm_checkpoints_exits_0_and_resumes_bitwise(ppo_reference, tmp_path):
    workdir = str(tmp_path / "run")
    p = launch(workdir)
    wait_for_step(p, workdir, 2)  # a step record logged: the run is in its step loop
    p.send_signal(signal.SIGTERM)
    rc, out, err = finish(p)
    assert rc == 0, err[-3000:]
    assert "SIGTERM: checkpoint written at step" in out + err
    last = max(step_records(workdir))
    assert max(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))) == last
    assert not os.path.exists(os.path.join(workdir, "summary.json"))
    assert not os.path.exists(os.path.join(workdir, "policy"))
    first_lines = open(os.path.join(workdir, "metrics.jsonl")).readlines()
    rc, out, err = finish(launch(workdir))
    assert rc == 0, err[-3000:]
    assert f"resumed from {os.path.join(os.path.abspath(workdir), 'checkpoints', str(last))}" in out
    assert open(os.path.join(workdir, "metrics.jsonl")).readlines()[:len(first_lines)] == first_lines  # appended
    assert step_records(workdir) == step_records(ppo_reference)
    assert json.load(open(os.path.join(workdir, "summary.json")))["start_step"] == last


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_bitwise(ppo_reference, tmp_path):
    """The stages' damage handling serves PPO: step 3's largest file of the opt_state item (optimizer states, critic,
    reference) with flipped bytes fails its checksum, the step is moved to corrupt_checkpoints/, and the run resumes
    from step 2 to the reference's records."""
    workdir = interrupted(ppo_reference, str(tmp_path / "run"), last=3)
    item = os.path.join(workdir, "checkpoints", "3", "opt_state")
    flip(max((os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs), key=os.path.getsize))
    rc, out, err = finish(launch(workdir))
    assert rc == 0, err[-3000:]
    assert "checkpoints/3 is damaged" in err and f"resumed from {os.path.join(workdir, 'checkpoints', '2')}" in out
    assert len(os.listdir(os.path.join(workdir, "corrupt_checkpoints"))) == 1
    assert step_records(workdir) == step_records(ppo_reference)


def test_changed_config_is_refused_in_one_line_and_nothing_is_touched(ppo_reference, tmp_path):
    for name, workdir in (("interrupted", interrupted(ppo_reference, str(tmp_path / "interrupted"))),
                          ("finished", shutil.copytree(ppo_reference, str(tmp_path / "finished")))):
        before = {f: open(os.path.join(workdir, f), "rb").read() for f in ("metrics.jsonl", "config.json")}
        steps = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
        rc, _, err = finish(launch(workdir, "--config.ppo.lam_actor=0.9"))
        assert rc == 2, (name, err[-3000:])
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("config error:") and "ppo.lam_actor: 0.95 -> 0.9" in lines[0], \
            (name, err)
        assert "--config.ppo.on_config_change=fresh" in lines[0]
        assert {f: open(os.path.join(workdir, f), "rb").read() for f in before} == before, name
        assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == steps, name


def test_a_finished_run_says_complete_and_does_nothing(ppo_reference, tmp_path):
    workdir = shutil.copytree(ppo_reference, str(tmp_path / "finished"))
    mtimes = {f: os.path.getmtime(os.path.join(workdir, f)) for f in ("metrics.jsonl", "summary.json", "policy")}
    rc, out, err = finish(launch(workdir))
    assert rc == 0, err[-3000:]
    assert f"stage ppo: already complete ({os.path.join(workdir, 'summary.json')})" in out
    assert {f: os.path.getmtime(os.path.join(workdir, f)) for f in mtimes} == mtimes


def test_on_config_change_fresh_archives_the_old_run(ppo_reference, tmp_path):
    """ppo.on_config_change="fresh": the old run's outputs move to archive/<time>/ and the run starts at step 0
    (checked before anything is built: `settle_checkpoints`)."""
    from configs import ppo_tiny
    from glmjax.rl.ppo import settle_checkpoints

    workdir = interrupted(ppo_reference, str(tmp_path / "run"))
    c = ppo_tiny.get_config()
    c.ppo.update(on_config_change="fresh")
    assert settle_checkpoints(c, workdir) is False  # ppo_tiny's own settings differ from the run's
    archived = os.listdir(os.path.join(workdir, "archive"))
    assert len(archived) == 1
    assert sorted(os.listdir(os.path.join(workdir, "archive", archived[0]))) == ["checkpoints", "interceptions.jsonl",
                                                                               "metrics.jsonl"]
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))
    c.ppo.update(on_config_change="error")
    assert settle_checkpoints(c, workdir) is False  # nothing left to resume: a fresh start


def test_generate_and_export_read_a_ppo_workdir(ppo_reference, tmp_path, capsys):
    """glmjax-generate --checkpoint <PPO workdir> is its final policy (the newest checkpoint holds it, as policy/
    does; an interrupted run's newest checkpoint serves too); glmjax-hf export <PPO workdir> writes policy/."""
    from glmjax.cli.generate import main as generate
    from glmjax.cli.hf import main as hf

    def ids(path):
        assert generate(["--checkpoint", path, "--prompt", "3+4=", "--max-new-tokens", "6", "--ids",
                         "--compilation-cache", ""]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    final = ids(os.path.join(ppo_reference, "policy"))
    assert ids(ppo_reference) == final
    cut = interrupted(ppo_reference, str(tmp_path / "cut"), last=STEPS)  # killed after its last checkpoint
    assert ids(cut) == final
    for src, out in ((ppo_reference, tmp_path / "hf_workdir"), (os.path.join(ppo_reference, "policy"),
                                                                  tmp_path / "hf_policy")):
        assert hf(["export", src, str(out), "--dtype", "F32", "--compilation-cache", ""]) == 0
    files = sorted(os.listdir(tmp_path / "hf_policy"))
    assert sorted(os.listdir(tmp_path / "hf_workdir")) == files
    for f in files:
        assert open(tmp_path / "hf_workdir" / f, "rb").read() == open(tmp_path / "hf_policy" / f, "rb").read(), f
