"""The Colab notebooks (notebooks/*.ipynb): committed clean, and executed top to bottom on CPU.

The run test executes every notebook top to bottom in a fresh Jupyter kernel with the "ci" size (a cell injected
after the "parameters" cell, as papermill does) and fails on any cell error. Notebooks that share training runs go
in one group, in order: 01 trains the recipe into the shared WORKDIR and 02, 03 reuse its stages, as in one Colab
session; 04 (PPO) is independent, a group of its own (pytest-xdist runs the groups side by side). Every figure a
notebook draws is an inline PNG output; they are written to $GLMJAX_NOTEBOOK_PLOTS (default: the test's tmp dir)
and each must be a real, non-blank picture.
"""
import base64
import glob
import os
import sys
import tempfile

import matplotlib.image as mpimg
import nbformat
import numpy as np
import pytest
from xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
FIGURES = {"01_quickstart": 1, "02_sparse_attention": 5, "03_indexshare": 3, "04_ppo": 2}  # figures drawn
GROUPS = [("01_quickstart", "02_sparse_attention", "03_indexshare"), ("04_ppo",)]
# Kernel environment: one CPU device and the pytest workers' fast compile (tests/xla_flags.py; it halves these tiny
# runs cold; the workers' fusion-emitter flag on top: 97 -> 74 s for the two groups alone, cold).
# Compilations go to the tests' persistent cache, the many small eager ones of model initialisation included.
KERNEL_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": xla_flags(worker=True),
    "JAX_COMPILATION_CACHE_DIR": os.environ.get("GLMJAX_TEST_CACHE",
                                                os.path.join(tempfile.gettempdir(), "glmjax_jax_cache")),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "PYTHONPATH": ROOT,
}


def name(path):
    return os.path.splitext(os.path.basename(path))[0]


def test_notebooks_are_committed_clean():
    assert {name(p) for p in NOTEBOOKS} == set(FIGURES) == {n for g in GROUPS for n in g}, NOTEBOOKS
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        for c in code:
            assert c.outputs == [] and c.execution_count is None, f"{name(path)}: outputs not stripped"
        head = nb.cells[0]
        assert head.cell_type == "markdown" and "colab-badge.svg" in head.source, f"{name(path)}: no Colab badge"
        assert f"/notebooks/{os.path.basename(path)})" in head.source, f"{name(path)}: the badge links elsewhere"
        assert "**Runtime.**" in head.source, f"{name(path)}: runtime needs not stated"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and tagged[0] is code[0], f"{name(path)}: the first code cell must be the one " \
                                                          "parameters cell"
        assert "SIZE =" in tagged[0].source and "STEPS =" in tagged[0].source


def with_parameters(nb, **values):
    """nb with a cell that sets `values` right after its parameters cell (papermill's "injected-parameters")."""
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items()))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(i + 1, cell)
    return nb


def figures(nb) -> list[bytes]:
    return [base64.b64decode(out.data["image/png"]) for c in nb.cells if c.cell_type == "code"
            for out in c.outputs if out.output_type in ("display_data", "execute_result") and "image/png" in out.data]


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: "+".join(n[:2] for n in g))
def test_notebooks_run_on_cpu(group, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    for k, v in KERNEL_ENV.items():
        monkeypatch.setenv(k, v)
    # the "python3" kernel spec starts `python` from PATH: make that this interpreter (a virtualenv, not activated)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend makes the PNG outputs
    plots = os.environ.get("GLMJAX_NOTEBOOK_PLOTS") or str(tmp_path / "plots")
    os.makedirs(plots, exist_ok=True)
    for path in (os.path.join(ROOT, "notebooks", n + ".ipynb") for n in group):
        nb = nbformat.read(path, as_version=4)
        with_parameters(nb, SIZE="ci", STEPS=None, WORKDIR=str(tmp_path / "runs"))
        client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
        nbformat.write(nb, str(tmp_path / os.path.basename(path)))  # the executed notebook
        pngs = figures(nb)
        assert len(pngs) == FIGURES[name(path)], f"{name(path)}: {len(pngs)} figures"
        for i, png in enumerate(pngs):
            out = os.path.join(plots, f"{name(path)}_{i + 1}.png")
            with open(out, "wb") as f:
                f.write(png)
            img = mpimg.imread(out)
            assert img.shape[0] >= 200 and img.shape[1] >= 300, (out, img.shape)
            assert np.std(img[..., :3]) > 0.05, f"{out}: a blank picture"
