"""AOT-compile the trainer's own training step (glmjax.train.step: forward, backward, optimizer, router-bias update,
non-finite guard) for a TPU topology on a CPU host and print the compiler's estimates: memory per chip, FLOPs,
step time, implied MFU. Estimates, not measurements: nothing runs, no TPU is needed.

    python bench/aot.py --config configs/glm5.py --topology v5p:8x8x16 --seq 4096 --batch 256 \
        --mesh fsdp=4,expert=64,tensor=4 --set remat=full --set moe_capacity_factor=2
    python bench/aot.py --config configs/small.py --topology v5e:2x4 --seq 256 --batch 8 --mesh data=8

Memory comes from compiling the real step (scanned layers, the config's loops). Time and FLOPs come from the
same step compiled with moe_impl=blocked (on TPU `ragged_dot` is a Mosaic kernel without a cost estimate),
counted with every while-loop body once per trip (glmjax/train/hlo_cost.py; XLA's own cost analysis counts a
body once): FLOPs as XLA counts them, HBM bytes scaled to XLA's count of the loop-once program, ICI bytes of the
collectives from the HLO. The block-skipping conditionals of blocked attention count as often as the layout
needs their blocks (`aot.needed_block_fraction`, one document per row). The Pallas kernels of pallas_kernels/
count with the cost they declare (`pl.CostEstimate`); JAX's splash attention declares none, so a dense step on
one context shard on TPU (splash, `dense_attention_impl` "auto") leaves its attention out of the counts (the log
says how many kernels are uncounted). `--estimate builds` is the older cross-check: unrolled builds whose every
loop runs one trip (layers unrolled, one loss chunk, one attention block, MTP for one depth; the dense layers +
1 and + 2 MoE layers, extrapolated linearly), counted by XLA alone. Model FLOPs (for MFU) come from
`glmjax.flops` (causal=False, the PaLM convention). Step time is a roofline of the counts with the chip's public
peaks (`glmjax.train.aot.roofline`, glmjax/hardware.py): between max(compute, HBM, ICI) (all overlapped) and
their sum (none); the compiler's own "optimal_seconds" is printed but not used (it goes negative for these
programs). The every-parameter-trains sparse step is the sparse-adaptation stage (LM + MTP + indexer KL).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

from glmjax import flops  # noqa: E402
from glmjax import parallel as par  # noqa: E402
from glmjax.config import ModelConfig  # noqa: E402
from glmjax.hardware import GiB, chip_of_topology  # noqa: E402
from glmjax.model import sparse_attention  # noqa: E402
from glmjax.train import aot, hlo_cost  # noqa: E402


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("_aot_config", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, ROOT)
    spec.loader.exec_module(module)
    return module.get_config()


def parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


@contextlib.contextmanager
def one_query_block():
    """Estimate builds: let the sparse attention take all queries in one block (its gathered-bytes budget would
    otherwise split them into loop trips, which cost analysis counts once)."""
    saved = sparse_attention.gather_block_bytes
    sparse_attention.gather_block_bytes = lambda: 1 << 62
    try:
        yield
    finally:
        sparse_attention.gather_block_bytes = saved


def compile_step(cfg: ModelConfig, optim, mesh, args):
    t = time.perf_counter()
    lowered = aot.lower_train_step(cfg, optim, mesh, args.batch, args.seq, stage=args.stage, mode=args.mode,
                                   index_loss_weight=args.index_loss_weight)
    compiled = aot.compile_uncached(lowered)
    return compiled, time.perf_counter() - t


def estimate(cfg: ModelConfig, optim, mesh, args, log) -> dict:
    """Whole-step FLOPs / bytes per chip from the real step (scanned layers, every loop) counted per trip
    (`aot.cost`'s "per_trip", glmjax/train/hlo_cost.py), the block-skipping conditionals taken as often as the
    layout needs them (`aot.needed_block_fraction`). moe_impl=blocked: on TPU `ragged_dot` is a Mosaic kernel
    without a cost estimate."""
    cfg = cfg.replace(moe_impl="blocked")
    compiled, secs = compile_step(cfg, optim, mesh, args)
    c = aot.cost(compiled)
    mem = aot.memory_per_chip(compiled)
    log(f"  estimate build memory per chip (moe_impl blocked): {mem['total'] / GiB:.2f} GiB (temporaries "
        f"{mem['temp'] / GiB:.2f})")
    if args.hlo_out:  # the program text, to count again (python -m glmjax.train.hlo_cost) without compiling
        with gzip.open(args.hlo_out, "wt") as f:
            f.write(compiled.as_text())
    del compiled
    pt = c["per_trip"]
    needed = aot.needed_block_fraction(args.seq, cfg.block_q, mesh.shape.get("context", 1), cfg.context_layout)
    est = {**hlo_cost.scale_conditionals(pt, needed), "optimal_seconds": c["optimal_seconds"],
           "loops_left": len(pt["unknown_trips"]), "uncounted_kernels": c["uncounted"]}
    log(f"  estimate build (the step, moe_impl blocked): compiled in {secs:.0f} s; XLA counts (loop bodies once) "
        f"{c['flops']:.4g} FLOP, {c['bytes']:.4g} HBM bytes; per trip {pt['flops']:.4g} FLOP, {pt['bytes']:.4g} HBM "
        f"bytes, {pt['comm_bytes']:.4g} ICI bytes, of which in block-skipping conditionals {pt['cond_flops']:.4g} "
        f"FLOP, {pt['cond_bytes']:.4g} bytes, taken {needed:.3f} of the time; {len(pt['loops'])} loops "
        f"({len(pt['unknown_trips'])} with an unknown trip count, counted once); {c['custom_calls']} kernels "
        f"({c['uncounted']} without a cost estimate: not counted)")
    for line in hlo_cost.loop_lines(pt["loops"]):
        log("    " + line)
    return est


def estimate_builds(cfg: ModelConfig, optim, mesh, args, log) -> dict:
    """The cross-check of `estimate`: unrolled one-trip builds (see the module doc) counted by XLA alone. They use
    moe_impl=blocked: on TPU `ragged_dot` is a Mosaic kernel, which cost analysis cannot see."""
    cfg = cfg.replace(moe_impl="blocked")
    L, L_dense = cfg.num_hidden_layers, cfg.first_k_dense_replace
    depth = cfg.mtp_depth if cfg.has_mtp else 0
    plan = {"a": (L if L <= 8 else min(L, L_dense + 1), False)}
    if L > 8:
        plan["b"] = (plan["a"][0] + 1, False)
    if depth:
        plan["m"] = (plan["a"][0], True)
    got = {}
    with one_query_block():
        for key, (layers, mtp) in plan.items():
            compiled, secs = compile_step(aot.estimate_build(cfg, args.seq, layers, mtp), optim, mesh, args)
            got[key] = aot.cost(compiled)
            log(f"  estimate build {key}: {layers} layers{' + MTP' if mtp else ''} (moe_impl blocked): "
                f"compiled in {secs:.0f} s, {got[key]['flops']:.4g} FLOP, {got[key]['bytes']:.4g} HBM bytes, "
                f"{got[key]['comm_bytes']:.4g} ICI bytes, loops left {got[key]['loops']}, "
                f"{got[key]['custom_calls']} kernels ({got[key]['uncounted']} without a cost estimate: not counted)")
    out = {}
    for k in ("flops", "bytes", "comm_bytes", "optimal_seconds"):
        v = got["a"][k]
        if "b" in got:
            v += (L - plan["a"][0]) * (got["b"][k] - got["a"][k])
        if "m" in got:
            v += depth * (got["m"][k] - got["a"][k])
        out[k] = v
    out["loops_left"] = max(g["loops"] for g in got.values())
    out["uncounted_kernels"] = max(g["uncounted"] for g in got.values())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--topology", required=True, help='e.g. "v5p:8x8x16" (v5p-2048), "v5e:2x4" (v5e-8)')
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="default: the config's train.seq_len")
    p.add_argument("--batch", type=int, default=None, help="global sequences per step; default train.batch_size")
    p.add_argument("--mesh", default="data=-1", help="axis sizes, e.g. fsdp=4,expert=64,tensor=4 (rest: data)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="ModelConfig override")
    p.add_argument("--optim", default=None, help="optimizer name override (adamw | muon | muon_split)")
    p.add_argument("--mode", default="sparse", choices=("dense", "sparse"))
    p.add_argument("--stage", default="sparse_adapt", help="which parameters train (glmjax/train/stages.py); MFU "
                   "always counts a step training every parameter")
    p.add_argument("--index-loss-weight", type=float, default=1.0)
    p.add_argument("--no-estimate", action="store_true", help="memory only (skip the estimate build)")
    p.add_argument("--estimate", default="loops", choices=("loops", "builds"),
                   help="loops: the step counted per loop trip (default); builds: unrolled one-trip builds")
    p.add_argument("--estimate-only", action="store_true", help="time / FLOPs only (skip the full-step compile)")
    p.add_argument("--hlo-out", default=None, help="write the estimate build's HLO text here (gzip)")
    p.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    args = p.parse_args(argv)

    c = load_config(args.config)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    cfg = ModelConfig.from_dict({**c.model.to_dict(), **{k: parse_value(v) for k, v in overrides.items()}})
    optim = c.optim.to_dict()
    if args.optim:
        optim["name"] = args.optim
    args.seq = args.seq or c.train.seq_len
    args.batch = args.batch or c.train.batch_size
    mesh_cfg = {"data": -1, **{k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(",") if kv)}}
    chip = chip_of_topology(args.topology)
    devices = aot.topology_devices(args.topology, args.num_slices)
    mesh = par.make_mesh(mesh_cfg, devices)
    chips = len(devices)
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"{args.config} on {args.topology} x{args.num_slices} ({chips} chips), mesh {dict(mesh.shape)}, "
        f"batch {args.batch} x seq {args.seq}, stage {args.stage}, {args.mode}, optimizer {optim['name']}, "
        f"overrides {overrides or '-'}")

    result = dict(config=args.config, topology=args.topology, num_slices=args.num_slices, chips=chips,
                  mesh=dict(mesh.shape), batch=args.batch, seq=args.seq, stage=args.stage, mode=args.mode,
                  optimizer=optim["name"],
                  overrides=overrides)
    hbm = chip.hbm_bytes
    if not args.estimate_only:
        try:
            compiled, compile_s = compile_step(cfg, optim, mesh, args)
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that cannot fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            msg = str(e).splitlines()[0]
            log(f"  full step does NOT fit: {msg}")
            result.update(hbm=hbm, fits=False, oom=msg)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(result) + "\n")
            return result
        mem = aot.memory_per_chip(compiled)
        log(f"  full step compiled in {compile_s:.0f} s: per chip arguments {mem['argument'] / GiB:.2f} GiB, "
            f"temporaries {mem['temp'] / GiB:.2f} GiB, outputs {mem['output'] / GiB:.2f} GiB (aliased "
            f"{mem['alias'] / GiB:.2f}), code {mem['code'] / GiB:.2f} GiB -> total {mem['total'] / GiB:.2f} GiB of "
            f"{hbm / GiB:.0f} GiB ({'fits' if mem['total'] <= hbm else 'does NOT fit'})")
        del compiled
        result.update(memory=mem, hbm=hbm, fits=mem["total"] <= hbm, compile_s=compile_s)
    mode = "dense" if args.mode == "dense" else "dsa_indexshare"
    model_flops = flops.flops_per_token(cfg, args.seq, "training", mode, causal=False,
                                        indexer_loss=args.mode == "sparse" and args.index_loss_weight > 0)["total"]
    model_flops_chip = model_flops * args.batch * args.seq / chips
    result["model_flops_per_chip"] = model_flops_chip
    if not args.no_estimate:
        est = (estimate if args.estimate == "loops" else estimate_builds)(cfg, optim, mesh, args, log)
        t = aot.roofline(est, chip.name)
        peak = chip.peak_bf16_flops
        result.update(estimate=est, time=t, peak_flops=peak, mfu_fast=model_flops_chip / (t["fast"] * peak),
                      mfu_slow=model_flops_chip / (t["slow"] * peak))
        log(f"  per chip: compiler FLOPs {est['flops']:.4g} (model {model_flops_chip:.4g}), HBM bytes "
            f"{est['bytes']:.4g}, ICI bytes {est['comm_bytes']:.4g} -> compute {t['compute']:.4g} s, memory "
            f"{t['memory']:.4g} s, network {t['network']:.4g} s")
        log(f"  estimated step {t['fast']:.4g} s (all overlapped) to {t['slow']:.4g} s (none): MFU "
            f"{100 * result['mfu_slow']:.1f}% to {100 * result['mfu_fast']:.1f}% of {peak / 1e12:.0f} TFLOP/s; "
            f"{args.batch * args.seq / t['slow'] / chips:,.0f} to {args.batch * args.seq / t['fast'] / chips:,.0f} "
            f"tokens/s/chip (compiler's own optimal_seconds: {est['optimal_seconds']:.4g})")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
