"""Per-chip memory and the compiler's cost estimate of the Pallas DSA kernels at GLM-5 shapes, compiled ahead of
time for TPU topologies (no TPU needed: jax[tpu]'s libtpu + jax.experimental.topologies).

    python bench/pallas_aot.py [--topologies v5e:2x2 v5p:2x2x2] [--seq-len 8192] [--json out.json]

Each kernel is compiled with Mosaic inside shard_map over all chips of the topology, one batch row per chip:
sparse_mla = forward + backward (jax.vjp; q [S,64,576], latent cache [S,576], indices [S,2048], bf16),
index_topk = forward (q [S,32,128], k [S,128], bf16). Memory is `compiled.memory_analysis()` per chip (the jitted
shard_map program: kernel operands and outputs plus XLA's temporaries around the kernels); cost is
`compiled.cost_analysis()`, which for a Mosaic call is the `pl.CostEstimate` the wrapper declares plus XLA's
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

from pallas_kernels.aot import GLM5, compile_kernel  # noqa: E402

MiB = 2 ** 20


def measure(topology: str, kernel: str, seq_len: int) -> dict:
    t0 = time.perf_counter()
    compiled, chips = compile_kernel(topology, kernel, {"S": seq_len})
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
    return dict(topology=topology, chips=chips, kernel=kernel, S=seq_len, compile_s=secs,
                argument_mib=mem.argument_size_in_bytes / MiB, output_mib=mem.output_size_in_bytes / MiB,
                temp_mib=mem.temp_size_in_bytes / MiB, code_mib=mem.generated_code_size_in_bytes / MiB,
                gflop=cost.get("flops", 0.0) / 1e9, gb_accessed=cost.get("bytes accessed", 0.0) / 1e9,
                transcendentals=cost.get("transcendentals", 0.0), est_ms=cost.get("optimal_seconds", 0.0) * 1e3,
                vmem_mib=vmem)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", nargs="+", default=["v5e:2x2", "v5p:2x2x2"])
    ap.add_argument("--seq-len", type=int, default=GLM5["S"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for topology in a.topologies:
        for kernel in ("sparse_mla", "index_topk"):
            rows.append(measure(topology, kernel, a.seq_len))
            print(f"{topology} {kernel}: compiled in {rows[-1]['compile_s']:.1f} s", flush=True)
    print("\n| topology | chips | kernel | S | HBM args MiB | outputs MiB | temp MiB | VMEM used MiB | code MiB "
          "| GFLOP | GB accessed | transcendentals | XLA est. ms |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        vmem = ", ".join(f"{k} {v:.1f}" for k, v in r["vmem_mib"].items())
        est = f"{r['est_ms']:.1f}" if r["est_ms"] >= 0 else "n/a"  # XLA reports a negative time when it has none
        print(f"| {r['topology']} | {r['chips']} | {r['kernel']} | {r['S']} | {r['argument_mib']:.1f} | "
              f"{r['output_mib']:.1f} | {r['temp_mib']:.1f} | {vmem} | {r['code_mib']:.2f} | {r['gflop']:.0f} | "
              f"{r['gb_accessed']:.1f} | {r['transcendentals']:.3g} | {est} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
