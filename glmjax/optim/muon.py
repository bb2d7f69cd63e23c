"""Muon for one parameter group, on optax.contrib.scale_by_muon, plus the per-head / per-part splitting of Muon-Split.

Update of one orthogonalised matrix W (a slice of a parameter: one layer, one expert, one head, one of W_UK/W_UV):

    M   <- momentum * M + (1 - momentum) * G                      (optax scale_by_muon, bias-corrected;
    N    = Nesterov: momentum * M_hat + (1 - momentum) * G_hat     nesterov=True)
    O    = NewtonSchulz5(N)                                       quintic (3.4445, -4.7750, 2.0315), Frobenius-normed
    W   <- W - lr * (s * O + weight_decay * W)                    decoupled weight decay
    s    = consistent_rms * sqrt(max(fan_in, fan_out))            (Liu et al. 2025, "Muon is scalable")

An orthogonal fan_in x fan_out matrix has RMS 1/sqrt(max(fan_in, fan_out)), so `s` sets the update RMS to
~consistent_rms (0.2: AdamW's typical update RMS) for every shape, and AdamW's lr and weight decay carry over.
Newton-Schulz with these coefficients leaves singular values in roughly [0.7, 1.2] (tests/test_optim.py measures
it), so the realised RMS is ~0.2 * rms(singular values).

Every axis that is neither a reduction nor an output axis is a batch axis: per-layer, per-expert and (in split mode)
per-head orthogonalisation. optax's scale_by_muon keeps the momentum; its own Newton-Schulz is switched off
(ns_steps=0 leaves only the Frobenius normalisation) because it vmaps over every matrix of a leaf at once, which for
GLM-5's stacked experts (75 layers x 256 experts) needs 638 GiB of temporaries per chip on v5p-2048
(docs/benchmarks.md). `orthogonalize` runs the stacked-layer axis as a loop instead: one layer's matrices at a time.

What dimension numbers cannot express is cutting one axis into parts (W_UK | W_UV of kv_b_proj, nope | rope of
q_b_proj): `split_parts` turns such a parameter into one leaf per part before the group's transformation and
`merge_parts` puts the parts back afterwards, so the Muon state (momentum) of a split parameter is stored per part.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from glmjax.optim.grouping import ParamInfo, Segment

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: maximal slope at 0, converges to ~[0.7, 1.2]


def newton_schulz(x, steps: int, eps: float):
    """NewtonSchulz5 of the last two axes of x (leading axes batched), each matrix Frobenius-normed first."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = jnp.swapaxes(x, -1, -2)
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + eps)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, -1, -2) if tall else x


def orthogonalize(x, dims: MuonDimensionNumbers, steps: int, eps: float, loop_axis: int | None):
    """Newton-Schulz of every (reduction x output) matrix of x; batch axes are all the others. loop_axis (a batch
    axis: the stacked layers) runs as a sequential `lax.map`, so temporaries hold one layer's matrices."""
    red, out = tuple(dims.reduction_axis), tuple(dims.output_axis)
    batch = [i for i in range(x.ndim) if i not in red + out]
    if loop_axis is not None:
        batch.remove(loop_axis)
        batch.insert(0, loop_axis)
    perm = batch + list(red) + list(out)
    xt = jnp.transpose(x, perm)
    lead = xt.shape[:len(batch)]
    m = xt.reshape(lead + (math.prod(x.shape[i] for i in red), math.prod(x.shape[i] for i in out)))
    if loop_axis is not None and x.shape[loop_axis] > 1:
        y = jax.lax.map(lambda one: newton_schulz(one, steps, eps), m)
    else:
        y = newton_schulz(m, steps, eps)
    return jnp.transpose(y.reshape(xt.shape), np.argsort(perm))


def orthogonalize_parts(dims: dict, steps: int, eps: float, loop_axes: dict) -> optax.GradientTransformation:
    """`orthogonalize` every leaf of a {part key: array} update."""

    def update_fn(updates, state, params=None):
        del params
        return {k: orthogonalize(u, dims[k], steps, eps, loop_axes[k]) for k, u in updates.items()}, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def part_key(info: ParamInfo, seg: Segment) -> str:
    return info.path if not seg.name else f"{info.path}#{seg.name}"


def split_parts(flat: dict, infos: dict[str, ParamInfo]) -> dict:
    """{path: array} -> {path or path#part: array}, cutting parameters whose Muon rule has several segments."""
    out = {}
    for k, x in flat.items():
        info = infos[k]
        if len(info.segments) > 1:
            for s in info.segments:
                out[part_key(info, s)] = jax.lax.slice_in_dim(x, s.start, s.stop, axis=s.axis)
        else:
            out[k] = x
    return out


def merge_parts(parts: dict, infos: dict[str, ParamInfo], order) -> dict:
    out = {}
    for k in order:
        info = infos[k]
        if len(info.segments) > 1:
            out[k] = jnp.concatenate([parts[part_key(info, s)] for s in info.segments], axis=info.segments[0].axis)
        else:
            out[k] = parts[k]
    return out


def rms_scale(seg: Segment, consistent_rms: float | None) -> float:
    if consistent_rms is None:  # Keller Jordan's width scaling
        return max(1.0, seg.fan_out / seg.fan_in) ** 0.5
    return consistent_rms * max(seg.fan_in, seg.fan_out) ** 0.5


def scale_by_constant(scales: dict[str, float]) -> optax.GradientTransformation:
    """Multiply each leaf of a {key: array} update by its own Python float."""

    def update_fn(updates, state, params=None):
        del params
        return {k: u * jnp.asarray(scales[k], u.dtype) for k, u in updates.items()}, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def muon_for_parts(infos: list[ParamInfo], schedule: optax.Schedule, *, momentum: float, nesterov: bool,
                   ns_steps: int, weight_decay: float, consistent_rms: float | None,
                   eps: float = 1e-8) -> optax.GradientTransformation:
    """Muon over a {part key: array} dict holding exactly the parts of `infos`."""
    dims, scales, loop_axes = {}, {}, {}
    for info in infos:
        for s in info.segments:
            k = part_key(info, s)
            dims[k] = MuonDimensionNumbers(reduction_axis=s.reduction_axis, output_axis=s.output_axis)
            scales[k] = rms_scale(s, consistent_rms)
            loop_axes[k] = info.axes.index("layers") if "layers" in info.axes else None
    return optax.chain(
        scale_by_muon(ns_coeffs=NS_COEFFS, ns_steps=0, beta=momentum, eps=eps, nesterov=nesterov,
                      weight_dimension_numbers=dims),  # momentum only (see the module doc)
        orthogonalize_parts(dims, ns_steps, eps, loop_axes),
        scale_by_constant(scales),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(schedule),
    )


class GroupedState(NamedTuple):
    grad_norms: dict  # clip group ("lm" | "indexer") -> global norm of its gradients at the last update (pre-clip)
    groups: dict  # optimizer group -> that group's optax state


def clip_by_group_norm(flat: dict, clip_of: dict[str, str], max_norms: dict[str, float]):
    """Global-norm clipping computed separately per clip group. -> (clipped flat dict, {clip group: pre-clip norm})."""
    sq = {}
    for k, g in flat.items():
        c = clip_of[k]
        sq[c] = sq.get(c, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
    norms = {c: jnp.sqrt(s) for c, s in sq.items()}
    factors = {c: (jnp.minimum(1.0, max_norms[c] / jnp.maximum(n, 1e-30)) if max_norms[c] else None)
               for c, n in norms.items()}
    out = {k: g if factors[clip_of[k]] is None else (g * factors[clip_of[k]]).astype(g.dtype)
           for k, g in flat.items()}
    return out, norms
