import os
import shutil
import sys
import tempfile

# Tests run on CPU; several virtual devices for the sharding tests, XLA's fast compile (tests/xla_flags.py; must be
# set before jax is imported).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xla_flags import xla_flags  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8, worker=True))

import jax  # noqa: E402
import pytest  # noqa: E402

# A persistent compilation cache shared by the xdist workers and by reruns: compiling dominates CPU test time.
CACHE = os.environ.get("GLMJAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "glmjax_jax_cache"))
jax.config.update("jax_compilation_cache_dir", CACHE)
os.environ.setdefault("GLMJAX_CACHE_DIR", CACHE)  # train.py / glmjax-* in a test's subprocess: the same cache
# Every program, the small ones too (as train.py caches them): eager model initialisation compiles one small program
# per parameter shape and op (~800 of 0.04 s in test_model.py); the other worker and later processes read them back.
# test_model.py alone, cold cache then rerun in a new process: 126 s, 48 s (74 s when only programs >= 0.5 s are kept).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small BPE tokenizer with a chat template, saved as a Hugging Face checkpoint's tokenizer files."""
    from hf_tokenizer_fixture import write_tokenizer

    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ref(tok_dir):
    """transformers' tokenizer of tok_dir: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """test_reliability.py's 10-step reference run (checkpoints 2-10, all kept), launched once per test run and
    shared by the xdist workers (the first to ask builds it under a file lock; the others wait and reuse it) and by
    test_resume.py. Tests copy it before they write."""
    from test_reliability import launch

    return shared_run(tmp_path_factory, "reference_run", launch)


@pytest.fixture(scope="session")
def ppo_reference(tmp_path_factory):
    """test_ppo_resume.py's uninterrupted PPO run (train.py, bench/fault_injection.py's PPO_FLAGS), shared as
    `reference` is."""
    from test_ppo_resume import launch

    return shared_run(tmp_path_factory, "ppo_reference_run", launch)


def shared_run(tmp_path_factory, name: str, launch) -> str:
    """The workdir of a run to the end of `launch(workdir)` (a Popen of train.py), built once per test run by the
    first xdist worker to ask (under a file lock; the others wait and reuse it)."""
    from filelock import FileLock

    from test_reliability import finish

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    workdir = os.path.join(root, name)
    with FileLock(workdir + ".lock"):
        if not os.path.exists(workdir):  # built aside and renamed when whole: a failed build leaves no half run
            partial = workdir + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            p = launch(partial)
            try:
                rc, out = finish(p)
            finally:
                p.kill()
            assert rc == 0, out[-3000:]
            os.rename(partial, workdir)
    return workdir


def pytest_collection_modifyitems(config, items):
    """Modules with a `slow` test run first (each module's tests stay together, in order, so module fixtures are
    built once): the two xdist workers start on the long tests and finish together on the short ones."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable


# Where the time goes: every test's compile seconds (jaxpr tracing + lowering + XLA compile or cache read, in this
# process; a test's subprocesses are not counted) beside its wall seconds, summed over set-up, call and teardown.
# The summary at the end of every run lists the slowest tests and the slowest modules.
_compile_s = [0.0]
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def _on_duration(event, seconds, **_):
    if event in _COMPILE_EVENTS:
        _compile_s[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


_reported = [0.0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the compile seconds since the previous report of this worker."""
    outcome = yield
    outcome.get_result().user_properties.append(("compile_s", _compile_s[0] - _reported[0]))
    _reported[0] = _compile_s[0]


_times = {}  # nodeid -> [wall seconds, compile seconds, start (epoch s), xdist worker]


def pytest_runtest_logreport(report):
    t = _times.setdefault(report.nodeid, [0.0, 0.0, report.start, getattr(getattr(report, "node", None),
                                                                           "gateway", None) and report.node.gateway.id])
    t[0] += report.duration
    t[1] += dict(report.user_properties).get("compile_s", 0.0)


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    if os.environ.get("GLMJAX_TEST_TIMES"):  # every test's [wall, compile, start, worker] as JSON, for analysis
        import json
        with open(os.environ["GLMJAX_TEST_TIMES"], "w") as f:
            json.dump(_times, f, indent=0)
    write = terminalreporter.write_line
    total = sum(t[0] for t in _times.values())
    write(f"\nslowest tests (wall s, of which compiling in the test's own process; {total:.0f} s over all tests):")
    for nodeid, (wall, comp, *_) in sorted(_times.items(), key=lambda kv: -kv[1][0])[:15]:
        write(f"{wall:8.1f} {comp:8.1f}  {nodeid}")
    modules = {}
    for nodeid, (wall, comp, *_) in _times.items():
        m = modules.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0])
        m[0] += wall
        m[1] += comp
        m[2] += 1
    write("slowest modules (wall s, compile s, tests):")
    for name, (wall, comp, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:10]:
        write(f"{wall:8.1f} {comp:8.1f} {n:4d}  {name}")
    workers = {}  # worker -> [busy s, first start, last end]: how evenly the xdist workers were loaded
    for wall, _, start, worker in _times.values():
        w = workers.setdefault(worker, [0.0, start, start])
        w[0], w[1], w[2] = w[0] + wall, min(w[1], start), max(w[2], start + wall)
    if len(workers) > 1:
        t0 = min(w[1] for w in workers.values())
        write("workers (busy s, last test ended at s): " + "; ".join(
            f"{k} {busy:.0f}, {end - t0:.0f}" for k, (busy, _, end) in sorted(workers.items())))
