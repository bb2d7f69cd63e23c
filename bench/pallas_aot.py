"""Per-chip memory, Mosaic's VMEM use, compile time and the compiler's cost estimate of the Pallas DSA kernels at
GLM-5 shapes and long contexts, compiled ahead of time for TPU topologies (no TPU needed: jax[tpu]'s libtpu +
jax.experimental.topologies).

    python bench/pallas_aot.py [--only v5p] [--json out.json]

Each kernel is compiled with Mosaic inside shard_map over all chips of the topology, one batch row per chip, with
row-major operands (as a model step's producers write them): sparse_mla = forward + backward (jax.vjp; q [S,64,576],
latent cache [T,576] bf16, indices [S,2048]); sparse_mla_fwd = forward only (prefill, or decode at S = 1 / 16);
index_topk = forward (q [S,32,128], k [T,128], bf16; queries at the last S cache slots). Memory is
`compiled.memory_analysis()` per chip (kernel operands and outputs plus XLA's temporaries around the kernels); cost
is `compiled.cost_analysis()`, which for a Mosaic call is the `pl.CostEstimate` the wrapper declares plus XLA's
own ops; "XLA est. ms" is its optimal_seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.aot import compile_kernel  # noqa: E402
from pallas_kernels.sparse_mla import MAX_ACC_BYTES, cache_layout  # noqa: E402

MiB = 2 ** 20


M = 2 ** 20
# (topology, kernel, shapes): GLM-5's 8K training sequence, its 202,752-token warm-up sequence, 1M-token decode
ROWS = [("v5e:2x2", "sparse_mla", dict(S=8192)), ("v5e:2x2", "index_topk", dict(S=8192)),
        ("v5p:2x2x1", "sparse_mla", dict(S=8192)), ("v5p:2x2x1", "index_topk", dict(S=8192)),
        ("v5p:2x2x1", "sparse_mla", dict(S=202_752)), ("v5p:2x2x1", "index_topk", dict(S=202_752)),
        ("v5p:2x2x1", "sparse_mla_fwd", dict(S=1, T=M)), ("v5p:2x2x1", "sparse_mla_fwd", dict(S=16, T=M)),
        ("v5p:2x2x1", "sparse_mla_fwd", dict(S=16, T=M, kw=dict(layout="packed"))),
        ("v5p:2x2x1", "index_topk", dict(S=16, T=M)), ("v5p:2x2x1", "index_topk", dict(S=M))]


def variant(kernel: str, shapes: dict) -> str:
    """The sparse_mla gather layout (and backward dkv accumulator) the row compiles."""
    if kernel == "index_topk":
        return "-"
    S, T = shapes["S"], shapes.get("T", shapes["S"])
    name = shapes.get("kw", {}).get("layout") or cache_layout("bfloat16", S, T, 2048)
    if kernel == "sparse_mla":
        name += ", dkv " + ("VMEM" if T * 640 * 4 <= MAX_ACC_BYTES else "HBM")
    return name


def measure(topology: str, kernel: str, shapes: dict) -> dict:
    t0 = time.perf_counter()
    compiled, chips = compile_kernel(topology, kernel, shapes)
    secs = time.perf_counter() - t0
    vmem = {}  # per Mosaic call: VMEM the kernel actually uses ("used_scoped_memory_configs" of the custom call)
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            name = re.search(r"(sparse_mla_fwd|sparse_mla_bwd|index_topk)", line).group(1)
            used = re.search(r'"used_scoped_memory_configs":\[\{[^}]*"size":"(\d+)"', line)
            vmem[name] = int(used.group(1)) / MiB if used else float("nan")
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(topology=topology, chips=chips, kernel=kernel, S=shapes["S"], T=shapes.get("T", shapes["S"]),
                variant=variant(kernel, shapes), compile_s=secs,
                argument_mib=mem.argument_size_in_bytes / MiB, output_mib=mem.output_size_in_bytes / MiB,
                temp_mib=mem.temp_size_in_bytes / MiB, code_mib=mem.generated_code_size_in_bytes / MiB,
                gflop=cost.get("flops", 0.0) / 1e9, gb_accessed=cost.get("bytes accessed", 0.0) / 1e9,
                transcendentals=cost.get("transcendentals", 0.0), est_ms=cost.get("optimal_seconds", 0.0) * 1e3,
                vmem_mib=vmem)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose topology starts with this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for topology, kernel, shapes in ROWS:
        if topology.startswith(a.only):
            rows.append(measure(topology, kernel, shapes))
            r = rows[-1]
            print(f"{topology} {kernel} S={r['S']} T={r['T']}: compiled in {r['compile_s']:.1f} s", flush=True)
    print("\n| topology | kernel | S | T | layout | HBM args MiB | outputs MiB | temp MiB | VMEM used MiB | compile s "
          "| GFLOP | GB accessed | XLA est. ms |")
    print("|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        vmem = ", ".join(f"{k} {v:.1f}" for k, v in r["vmem_mib"].items())
        est = f"{r['est_ms']:.1f}" if r["est_ms"] >= 0 else "n/a"  # XLA reports a negative time when it has none
        print(f"| {r['topology']} | {r['kernel']} | {r['S']:,} | {r['T']:,} | {r['variant']} | "
              f"{r['argument_mib']:.1f} | {r['output_mib']:.1f} | {r['temp_mib']:.1f} | {vmem} | "
              f"{r['compile_s']:.1f} | "
              f"{r['gflop']:.0f} | {r['gb_accessed']:.1f} | {est} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
