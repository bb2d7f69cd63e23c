"""Trip-count-aware cost of a compiled XLA program, read from its HLO text: FLOPs, transcendentals, HBM bytes and
ICI bytes per chip with every while-loop body counted once per trip.

XLA's `cost_analysis` counts a loop body once, so the cost of a scanned model, a blocked attention or a chunked
loss is that of one trip. This module walks the optimized HLO of `compiled.as_text()` instead:

* a while loop's trip count comes from its condition (`counter < N`, or `<=`, `>`, ...) and the counter's initial
  constant in the loop's operand tuple; a loop whose count cannot be read counts once and is listed as unknown;
* a conditional counts its most expensive branch (as XLA does); what its branches cost inside loops is also kept
  apart ("cond_*"), for a caller who knows how often the branch runs (`scale_conditionals`);
* FLOPs: a dot 2 x output x contracted size; a convolution (TPU's form of most dots) 2 x output x the kernel's
  size per output feature; an elementwise op its output size, a reduce its input size (exp, log, tanh, ... count
  as transcendentals);
* HBM bytes: every instruction outside fusions reads its operands and writes its result; a fusion reads only the
  slices it takes of an operand (slice, dynamic-slice, gather: as many elements as they return) and writes only
  the update of an in-place dynamic-update-slice (the per-trip slice of a scan's stacked input or output, not the
  whole stack);
* ICI bytes: a collective moves about its result (an all-reduce twice, a reduce-scatter its input), the (n-1)/n
  factors dropped;
* a Mosaic kernel ("tpu_custom_call") counts with the `pl.CostEstimate` it declares; one without (JAX's splash
  attention, ragged_dot on TPU) counts nothing and is listed as uncounted.

These are the same rules as XLA's own analysis where they overlap (`tests/test_hlo_cost.py` compares both on
programs without loops) -- estimates from the program text, not measurements.
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                        r"collective-permute)(-start)?\((.*)")
# elementwise ops: 0 counts their elements as FLOPs, 1 as transcendentals
ELEMENTWISE = {op: 0 for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select",
                                "and", "or", "xor", "not", "negate", "abs", "sign", "floor", "ceil", "clamp",
                                "round-nearest-even", "round-nearest-afz", "remainder", "shift-left",
                                "shift-right-logical", "shift-right-arithmetic", "is-finite", "convert")}
ELEMENTWISE.update({op: 1 for op in ("exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                                     "logistic", "rsqrt", "sqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2",
                                     "erf")})
NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "async-done",
              "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done", "send-done", "recv-done"}
N_FIELDS = 4  # flops, transcendentals, bytes, comm_bytes


@dataclasses.dataclass
class Inst:
    name: str
    type: str  # the result type text, e.g. "f32[8,128]{1,0}" or a tuple "(s32[], bf16[4])"
    op: str
    operands: list[str]
    attrs: str
    line: str


def _matching(text: str, i: int) -> int:
    """Index just past the bracket that closes the one at text[i]."""
    pairs, depth = {"(": ")", "{": "}", "[": "]"}, []
    for j in range(i, len(text)):
        c = text[j]
        if c in pairs:
            depth.append(pairs[c])
        elif depth and c == depth[-1]:
            depth.pop()
            if not depth:
                return j + 1
    return len(text)


def _parse_inst(line: str) -> Inst | None:
    line = re.sub(r"/\*.*?\*/", "", line.strip())
    if line.startswith("ROOT "):
        line = line[5:]
    m = re.match(r"%?([\w.\-]+) = ", line)
    if not m:
        return None
    rest = line[m.end():]
    end = _matching(rest, 0) if rest.startswith("(") else rest.index(" ")
    typ, rest = rest[:end], rest[end:].lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    close = _matching(rest, om.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[om.end():close - 1])
    return Inst(m.group(1), typ, om.group(1), operands, rest[close:], line)


def parse(text: str) -> tuple[dict[str, list[Inst]], str]:
    """HLO module text -> ({computation name: instructions}, entry computation name)."""
    comps, entry, current = {}, None, None
    for raw in text.splitlines():
        if not raw.startswith(" ") and raw.rstrip().endswith("{") and "(" in raw:
            head = raw.split("(", 1)[0].split()
            current = head[-1].lstrip("%")
            comps[current] = []
            if head[0] == "ENTRY":
                entry = current
        elif raw.startswith("}"):
            current = None
        elif current is not None:
            inst = _parse_inst(raw)
            if inst is not None:
                comps[current].append(inst)
    return comps, entry


def arrays(typ: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in ARRAY.findall(typ)]


def nbytes(typ: str) -> int:
    return sum(DTYPE_BYTES.get(d, 4) * int(np.prod(s, dtype=np.int64)) for d, s in arrays(typ))


def nelems(typ: str) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for _, s in arrays(typ))


def _group_size(attrs: str) -> int:
    """Devices in one replica group: mesh['a'=8,'b'=2] {'a'} -> 8; [4,2]<=[8] -> 2; {{0,1},{2,3}} -> 2."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
    if m:
        sizes = dict((k.strip("'"), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(",")))
        return int(np.prod([sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip()]))
    m = re.search(r"replica_groups=\[[\d,]*?(\d+)\]<=", attrs)
    if m:
        return int(m.group(1))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    return len(m.group(1).split(",")) if m else 1


def collective_line_bytes(line: str) -> float:
    """ICI bytes one chip sends for the collective on this HLO line (0 if it is none): all-gather / all-to-all /
    permute move about their result, a reduce-scatter its input (result x group), an all-reduce twice its result;
    for an async "-start" the largest array of the result tuple (it also holds the input)."""
    m = COLLECTIVE.search(line)
    if not m:
        return 0.0
    types, op, start, rest = m.groups()
    sizes = [DTYPE_BYTES.get(d, 4) * int(np.prod(s, dtype=np.int64)) for d, s in arrays(types)]
    n = _group_size(rest)
    if not sizes or n <= 1:
        return 0.0
    return (max(sizes) if start else sum(sizes)) * {"all-reduce": 2, "reduce-scatter": n}.get(op, 1)


def collective_bytes(hlo_text: str) -> float:
    """ICI bytes of every collective in the text, each loop body counted once (`collective_line_bytes`)."""
    return sum(collective_line_bytes(line) for line in hlo_text.splitlines())


def _window(attrs: str, key: str, rank: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([\dx_\-]+)", attrs)
    return [int(v) for v in m.group(1).split("x")] if m else [default] * rank


def conv_flops(inst: Inst, shapes: dict) -> float:
    """2 x multiply-adds of a convolution: per output element, the kernel's input features times the kernel
    positions that land on an input element (not on padding or a dilation hole) -- TPU writes a dot's batch
    dimensions as such windows (size n, lhs_dilate n), where one position of n lands."""
    labels = re.search(r"dim_labels=([^_]+)_([^-]+)->(\S+?)[,\s]", inst.attrs + " ")
    lhs, rhs = (arrays(shapes.get(o, "")) for o in inst.operands[:2])
    if not labels or not lhs or not rhs:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    out = arrays(inst.type)[0][1]
    spatial = [c for c in rhs_l if c.isdigit()]
    n = len(spatial)
    size = _window(inst.attrs, "size", n, 1)
    stride = _window(inst.attrs, "stride", n, 1)
    lhs_dil = _window(inst.attrs, "lhs_dilate", n, 1)
    rhs_dil = _window(inst.attrs, "rhs_dilate", n, 1)
    pads = re.search(r"\bpad=([\dx_\-]+)", inst.attrs)
    pad_lo = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * n
    macs_per_out = float(rhs[0][1][rhs_l.index("i")])
    for d, c in enumerate(spatial):
        N, O = lhs[0][1][lhs_l.index(c)], out[out_l.index(c)]
        pos = (np.arange(O)[:, None] * stride[d] + np.arange(size[d])[None, :] * rhs_dil[d] - pad_lo[d])
        valid = (pos >= 0) & (pos <= (N - 1) * lhs_dil[d]) & (pos % lhs_dil[d] == 0)
        macs_per_out *= valid.sum() / max(O, 1)
    return 2.0 * nelems(inst.type) * macs_per_out


def source_lines(text: str) -> dict[int, str]:
    """{stack_frame_id: "path/file.py:line (function)"} from the module's StackFrames / FileLocations tables (the
    innermost frame of an instruction's `stack_frame_id`); paths from their last "glmjax/" or "pallas_kernels/"."""
    tables, current = {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and re.match(r"\d+ ", line):
            key, value = line.split(" ", 1)
            current[int(key)] = value.strip().strip('"')
        else:
            current = None
    field = lambda v, k: int(re.search(rf"{k}=(\d+)", v).group(1))  # noqa: E731
    out = {}
    for frame, v in tables.get("StackFrames", {}).items():
        loc = tables.get("FileLocations", {}).get(field(v, "file_location_id"), "")
        if not loc:
            continue
        path = tables.get("FileNames", {}).get(field(loc, "file_name_id"), "?")
        path = path[max(path.rfind("glmjax/"), path.rfind("pallas_kernels/"), 0):]
        func = tables.get("FunctionNames", {}).get(field(loc, "function_name_id"), "?")
        out[frame] = f"{path}:{field(loc, 'line')} ({func})"
    return out


class Counter:
    """Cost of each computation of one HLO module, loops multiplied by their trip counts (see the module doc)."""

    def __init__(self, text: str, per_trip: bool = True):
        self.comps, self.entry = parse(text)
        self.per_trip = per_trip
        self.shapes = {c: {i.name: i.type for i in insts} for c, insts in self.comps.items()}
        self.sources = source_lines(text)
        self.loops, self.kernels, self.unknown_trips = [], [], []
        self._memo = {}

    def trips(self, comp: str, inst: Inst) -> int | None:
        """Trip count of a while loop: its condition's root compares a counter (a tuple element) with a constant;
        the counter starts at the constant in the loop's operand tuple (loops step by one, as lax loops do)."""
        cond = re.search(r"condition=%?([\w.\-]+)", inst.attrs).group(1)
        insts = {i.name: i for i in self.comps.get(cond, [])}
        root = self.comps[cond][-1] if self.comps.get(cond) else None
        if root is None or root.op != "compare" or len(root.operands) != 2:
            return None
        direction = re.search(r"direction=(\w+)", root.attrs).group(1)
        a, b = (insts.get(o) for o in root.operands)
        if a is None or b is None:
            return None
        if a.op == "constant":
            a, b = b, a
            direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
        if b.op != "constant" or a.op != "get-tuple-element":
            return None
        bound = int(re.search(r"constant\((-?\d+)\)", b.line).group(1))
        index = int(re.search(r"index=(\d+)", a.attrs).group(1))
        start = self._initial(comp, inst, index)
        if start is None:
            return None
        n = {"LT": bound - start, "LE": bound - start + 1, "GT": start - bound, "GE": start - bound + 1}.get(direction)
        return max(n, 0) if n is not None else None

    def _initial(self, comp: str, inst: Inst, index: int) -> int | None:
        insts = {i.name: i for i in self.comps[comp]}
        tup = insts.get(inst.operands[0]) if inst.operands else None
        if tup is None or tup.op != "tuple" or index >= len(tup.operands):
            return None
        init = insts.get(tup.operands[index])
        while init is not None and init.op in ("copy", "bitcast") and init.operands:
            init = insts.get(init.operands[0])
        if init is None or init.op != "constant":
            return None
        return int(re.search(r"constant\((-?\d+)\)", init.line).group(1))

    def cost(self, comp: str, fused: bool = False) -> np.ndarray:
        """[2, 4]: (flops, transcendentals, HBM bytes, ICI bytes) in total and inside conditional branches."""
        key = (comp, fused)
        if key not in self._memo:
            self._memo[key] = sum((self.inst_cost(comp, i, fused) for i in self.comps.get(comp, [])),
                                  np.zeros((2, N_FIELDS)))
        return self._memo[key]

    def inst_cost(self, comp: str, inst: Inst, fused: bool) -> np.ndarray:
        out = np.zeros((2, N_FIELDS))
        shapes = self.shapes[comp]
        called = lambda attr: re.findall(attr + r"=%?([\w.\-]+)", inst.attrs)  # noqa: E731
        if inst.op == "while":
            body = called("body")[0]
            n = self.trips(comp, inst)
            per_trip = self.cost(body) + self.cost(called("condition")[0])
            name, frame = re.search(r'op_name="([^"]*)"', inst.attrs), re.search(r"stack_frame_id=(\d+)", inst.attrs)
            self.loops.append(dict(computation=body, trips=n, flops_per_trip=float(per_trip[0, 0]),
                                   op_name=name.group(1) if name else "",
                                   source=self.sources.get(int(frame.group(1)), "") if frame else ""))
            if n is None:
                self.unknown_trips.append(body)
            return per_trip * (n if self.per_trip and n is not None else 1)
        if inst.op == "conditional":
            listed = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
            branches = (re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed
                        else called("true_computation") + called("false_computation"))
            best = max((self.cost(b) for b in branches), key=lambda c: c[0, 0] + c[0, 2], default=out)
            return np.stack([best[0], best[0]])
        if inst.op == "fusion":
            inner = self.cost(called("calls")[0], fused=True)
            out[:, :2] = inner[:, :2]
            out[0, 2] = self.fusion_bytes(comp, inst, called("calls")[0])
            return out
        if inst.op in ("call", "async-start") or (inst.op.endswith("-start") and called("calls")):
            return self.cost((called("to_apply") or called("calls"))[0], fused)
        if inst.op == "custom-call" and 'custom_call_target="tpu_custom_call"' in inst.attrs:
            m = re.search(r'"cost_estimate":(\{[^}]*\})', inst.attrs)
            self.kernels.append(dict(name=inst.name, counted=m is not None))
            if m:
                est = json.loads(m.group(1))
                out[0, :3] = [float(est.get("flops", 0)), float(est.get("transcendentals", 0)),
                              float(est.get("bytes_accessed", 0))]
            return out
        out[0, :2] = self.op_flops(inst, shapes)
        if not fused:
            out[0, 2] = self.traffic(inst, shapes)
            out[0, 3] = collective_line_bytes(inst.line)
        return out

    def op_flops(self, inst: Inst, shapes: dict) -> tuple[float, float]:
        if inst.op == "dot":
            lhs = arrays(shapes.get(inst.operands[0], ""))
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
            k = int(np.prod([lhs[0][1][int(d)] for d in dims.group(1).split(",") if d])) if lhs and dims else 1
            return 2.0 * nelems(inst.type) * k, 0.0
        if inst.op == "convolution":
            return conv_flops(inst, shapes), 0.0
        if inst.op in ("reduce", "reduce-window"):
            return float(nelems(shapes.get(inst.operands[0], ""))), 0.0
        kind = ELEMENTWISE.get(inst.op)
        if kind is None:
            return 0.0, 0.0
        return (float(nelems(inst.type)), 0.0) if kind == 0 else (0.0, float(nelems(inst.type)))

    def traffic(self, inst: Inst, shapes: dict) -> float:
        if inst.op in NO_TRAFFIC:
            return 0.0
        if inst.op in ("dynamic-slice", "gather"):  # reads what it takes (and a gather its indices)
            return 2.0 * nbytes(inst.type) + sum(nbytes(shapes.get(o, "")) for o in inst.operands[1:])
        if inst.op == "dynamic-update-slice":
            return 2.0 * nbytes(shapes.get(inst.operands[1], ""))
        return nbytes(inst.type) + sum(nbytes(shapes.get(o, "")) for o in inst.operands)

    def fusion_bytes(self, comp: str, inst: Inst, fused_comp: str) -> float:
        """A fusion reads each operand, or only the slices a dynamic-slice takes of it, and writes its result, or
        only the update of a dynamic-update-slice into an operand it aliases (in place)."""
        body = self.comps.get(fused_comp, [])
        params = {i.name: int(re.search(r"parameter\((\d+)\)", i.line).group(1)) for i in body if i.op == "parameter"}
        by_name = {i.name: i for i in body}
        root = body[-1] if body else None
        outputs = [by_name.get(o) for o in root.operands] if root is not None and root.op == "tuple" else [root]
        written, in_place = 0.0, set()
        for o in outputs:
            if o is not None and o.op == "dynamic-update-slice" and o.operands and o.operands[0] in params:
                in_place.add(o.operands[0])
                written += nbytes(self.shapes[fused_comp].get(o.operands[1], ""))
            elif o is not None:
                written += nbytes(o.type)
        shapes = self.shapes[comp]
        read = sum(self.param_read(fused_comp, p, nbytes(shapes.get(inst.operands[idx], "")))
                   for p, idx in params.items() if p not in in_place and idx < len(inst.operands))
        return read + written

    def param_read(self, fused_comp: str, param: str, full: float) -> float:
        """Bytes a fused computation reads of its parameter `param` (full: the whole operand)."""
        return full * self.read_fraction(fused_comp, param, 1.0)

    def read_fraction(self, comp: str, name: str, at_root: float) -> float:
        """Share of value `name` of fused computation `comp` that is read: only what (dynamic-)slices take, also
        through bitcasts, copies, converts and nested fusions; at_root: the share the consumer of comp's result
        reads (a nested fusion's result may itself be sliced); otherwise all of it."""
        body = self.comps.get(comp, [])
        users = [i for i in body if name in i.operands]
        elems = max(nelems(self.shapes[comp].get(name, "")), 1)
        if body and body[-1].name == name:
            users.append(None)
        read = 0.0
        for u in users:
            if u is None:
                read += at_root
            elif u.op in ("slice", "dynamic-slice", "gather") and u.operands[0] == name:
                read += nelems(u.type) / elems
            elif u.op in ("bitcast", "copy", "convert") or (u.op in ELEMENTWISE and nelems(u.type) == elems):
                read += self.read_fraction(comp, u.name, at_root)
            elif u.op == "fusion":
                inner = re.search(r"calls=%?([\w.\-]+)", u.attrs).group(1)
                inner_params = {int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name
                                for i in self.comps.get(inner, []) if i.op == "parameter"}
                out_read = self.read_fraction(comp, u.name, at_root)
                read += sum(self.read_fraction(inner, inner_params[k], out_read)
                            for k, o in enumerate(u.operands) if o == name and k in inner_params)
            else:
                return 1.0
            if read >= 1.0:
                return 1.0
        return read


def count(text: str, per_trip: bool = True) -> dict:
    """Per chip: flops, transcendentals, bytes (HBM), comm_bytes (ICI) with every loop counted per trip; the same
    inside conditional branches ("cond_flops", ...); loops [{computation, trips, flops_per_trip, op_name, source}];
    unknown_trips (loops counted once); kernels / uncounted (Mosaic calls, those without a cost estimate).
    per_trip=False counts every loop body once, as XLA's cost analysis does."""
    c = Counter(text, per_trip)
    total = c.cost(c.entry)
    names = ("flops", "transcendentals", "bytes", "comm_bytes")
    out = dict(zip(names, map(float, total[0])))
    out.update({f"cond_{k}": float(v) for k, v in zip(names, total[1])})
    out.update(loops=c.loops, unknown_trips=c.unknown_trips, kernels=len(c.kernels),
               uncounted=sum(not k["counted"] for k in c.kernels))
    return out


def loop_lines(loops: list[dict]) -> list[str]:
    """`count`'s loops grouped by source line and trip count, one line each."""
    groups = {}
    for loop in loops:
        key = (loop["source"] or loop["op_name"], loop["trips"])
        groups[key] = groups.get(key, 0) + 1
    return [f"{n} loop(s) of {trips} trips at {where}" for (where, trips), n in sorted(groups.items(), key=str)]


def scale_conditionals(counts: dict, fraction: float) -> dict:
    """`counts` with the conditional branches counted as running `fraction` of the time instead of always (for
    branches that skip blocks, fraction = the share of blocks that run)."""
    out = dict(counts)
    for k in ("flops", "transcendentals", "bytes", "comm_bytes"):
        if k in counts:
            out[k] = counts[k] - (1.0 - fraction) * counts[f"cond_{k}"]
    return out


def main(argv=None):
    """python -m glmjax.train.hlo_cost PROGRAM.hlo[.gz]: the per-trip counts of a saved program text
    (`bench/aot.py --hlo-out`) and its loops by source line."""
    import argparse
    import gzip
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("path")
    path = p.parse_args(argv).path
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"cannot read {path}: {e}")
    if parse(text)[1] is None:
        p.error(f"{path}: no ENTRY computation; expected the text of a compiled HLO module (compiled.as_text())")
    once, c = count(text, per_trip=False), count(text)
    for k in ("flops", "transcendentals", "bytes", "comm_bytes"):
        print(f"{k:>16}: per trip {c[k]:.4g} (of which in conditional branches {c['cond_' + k]:.4g}); "
              f"bodies once {once[k]:.4g}")
    print(f"kernels {c['kernels']} ({c['uncounted']} without a cost estimate); loops with an unknown trip count "
          f"{len(c['unknown_trips'])}")
    for line in loop_lines(c["loops"]):
        print("  " + line)


if __name__ == "__main__":
    main()
