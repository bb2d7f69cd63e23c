"""The accelerators glmjax knows: one row per chip with its public peak numbers, for MFU (the trainer, bench/) and
for the roofline of ahead-of-time compiled steps (glmjax/train/aot.py).

    chip_of_device(jax.devices()[0])      # by jax device_kind, e.g. "TPU v5 lite" -> v5e; None if unknown
    chip_of_topology("v5p:8x8x16")        # by TPU topology name -> v5p; ValueError if unknown
"""
from __future__ import annotations

import dataclasses

import jax

GiB = 2 ** 30
GPU_PLATFORMS = ("gpu", "cuda")  # jax's platform names of an NVIDIA GPU


def platform(mesh=None) -> str:
    """The platform the code is traced for: the devices of `mesh` (default: the abstract mesh in context; so an AOT
    compile for a TPU topology from a CPU host is "tpu"), else the default backend."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    dev = None if mesh.empty else mesh.abstract_device
    return dev.platform if dev is not None else jax.default_backend()


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16_flops: float  # dense bf16 FLOP/s per chip
    hbm_bytes: int | None  # None: not tabulated (the chip is only used for MFU)
    hbm_bandwidth: float | None  # bytes/s per chip
    ici_bandwidth: float | None  # bytes/s per chip, all links
    device_kinds: tuple[str, ...]  # jax `device_kind` prefixes of this chip
    topology: str | None = None  # the chip's name in TPU topology names ("v5p" in "v5p:2x2x2")


CHIPS = {c.name: c for c in (
    Chip("v4", 275e12, 32 * GiB, 1228e9, 300e9, ("TPU v4",), "v4"),
    Chip("v5e", 197e12, 16 * GiB, 819e9, 200e9, ("TPU v5 lite", "TPU v5e"), "v5e"),
    Chip("v5p", 459e12, 95 * GiB, 2765e9, 600e9, ("TPU v5p", "TPU v5"), "v5p"),
    Chip("v6e", 918e12, 32 * GiB, 1640e9, 448e9, ("TPU v6 lite", "TPU v6e"), "v6e"),
    Chip("h100", 989e12, None, None, None, ("NVIDIA H100",)),
    Chip("h200", 989e12, None, None, None, ("NVIDIA H200",)),
    Chip("a100", 312e12, None, None, None, ("NVIDIA A100",)),
)}


def chip_of_device(device) -> Chip | None:
    """The chip whose longest device_kind prefix matches `device.device_kind` (None: unknown, e.g. a CPU)."""
    kind = getattr(device, "device_kind", "")
    matches = [(len(p), c) for c in CHIPS.values() for p in c.device_kinds if kind.startswith(p)]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def chip_of_topology(topology_name: str) -> Chip:
    """"v5p:8x8x16" -> the v5p row."""
    gen = topology_name.split(":")[0].lower()
    by_name = {c.topology: c for c in CHIPS.values() if c.topology}
    if gen not in by_name:
        raise ValueError(f"topology {topology_name!r}: unknown chip {gen!r} (known: {sorted(by_name)})")
    return by_name[gen]
