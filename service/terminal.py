"""Terminal rendering of plans and predictions (``meshplan show`` / ``estimate``).

Plain aligned text, no colour codes, so output can be piped and diffed; the
placement words match the browser viewer's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from planner.schema import Plan, Prediction, binary_size, shard_dim


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces (the standard library has none)."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms"


def nbytes(b: int | None) -> str:
    return "-" if b is None else binary_size(b)


# GPT-2's projections are transformers' Conv1D, whose weight is stored [in, out]
_CONV1D = re.compile(r"(^|\.)c_(attn|fc|proj)\.weight$")


def _input_dim_first(fqn: str) -> bool:
    """Whether a 2-D weight's dim 0 is not its output features, as a Linear's is: an
    embedding's [vocab, hidden] and GPT-2's Conv1D [in, out] (whose column-wise split, of
    the outputs, is S(1): it read "row-sharded", audit)."""
    parts = fqn.split(".")
    return any(p.startswith("embed") or p in ("wte", "wpe") for p in parts[:-1]) or bool(_CONV1D.search(fqn))


def placement_word(plan: Plan, fqn: str, shape: list[int] | None, dim: str, placement: str) -> str:
    """Names as torch's parallel styles use them: a Linear weight [out, in] split on
    dim 0 is column-wise, on dim 1 row-wise; an Embedding [vocab, hidden] and GPT-2's
    Conv1D [in, out] the reverse."""
    if plan.dp_mode(dim) == "fully_shard":  # FSDP stores a shard whatever the logical placement
        return f"fully sharded {placement}"
    d = shard_dim(placement)
    if d is None:
        return "replicated R"
    if shape is not None and len(shape) == 2 and d < 2:
        colwise = (d == 0) != _input_dim_first(fqn)
        return f"{'column' if colwise else 'row'}-sharded {placement}"
    return f"sharded {placement}"


def _local_shape(plan: Plan, shape: list[int] | None, placements: list[str]) -> str:
    """Explicit shards first, then FSDP's dim-0 split of what is left on fully_shard dims."""
    if shape is None:
        return "?"
    local = list(shape)
    for p, dim in zip(placements, plan.mesh.dims, strict=True):
        d = shard_dim(p)
        if d is not None:
            local[d] = -(-local[d] // dim.size)
    for p, dim in zip(placements, plan.mesh.dims, strict=True):
        if p == "R" and plan.dp_mode(dim.name) == "fully_shard" and local:
            local[0] = -(-local[0] // dim.size)
    return str(local)


def render_prediction(pred: Prediction) -> str:
    t, m = pred.time, pred.memory
    head = (f"step time {seconds(t.step_time_s)}   tokens/s/device {pred.tokens_per_s_per_device:,.0f}"
            f"   MFU {pred.mfu * 100:.1f}%   memory {nbytes(m.total)} of {nbytes(m.capacity)}"
            + (f" ({nbytes(m.usable)} usable)" if m.usable is not None else "")
            + f"   {'fits' if m.fits else 'DOES NOT FIT'}")
    times = table(["time", "seconds"], [
        ("compute", seconds(t.compute_s)), ("  of it recomputation", seconds(t.recompute_s)),
        ("communication (all)", seconds(t.communication_s)),
        ("communication (exposed)", seconds(t.exposed_communication_s)),
        ("  of it resharding", seconds(t.resharding_s)), ("pipeline bubble", seconds(t.pipeline_bubble_s)),
        ("optimizer", seconds(t.optimizer_s)), ("step", seconds(t.step_time_s))])
    memory = table(["memory per device", "bytes"], [
        ("parameters", nbytes(m.parameters)), ("gradients", nbytes(m.gradients)),
        ("optimizer", nbytes(m.optimizer)), ("activations", nbytes(m.activations)),
        ("FSDP2 gathered", nbytes(m.fsdp_gathered)), ("total", nbytes(m.total)), ("capacity", nbytes(m.capacity)),
        *([("usable (capacity less headroom)", nbytes(m.usable))] if m.usable is not None else [])])
    return "\n\n".join([head, times, memory])


def render_pipeline(plan: Plan) -> str:
    """A pipeline plan's stages: what each runs and its predicted time (the split need not
    be even: a stage of cheaper layers, or beside the embedding, takes more)."""
    assert plan.pipeline is not None  # noqa: S101
    pp = plan.pipeline
    ranks = plan.mesh.size_of(pp.dim)
    per_rank = pp.virtual_stages > 1 and len(pp.stages) == ranks  # dealt out to virtual stages by apply
    head = (f"pipeline: {pp.schedule} on {pp.dim}={ranks}, {len(pp.stages)} stages, {pp.virtual_stages} per rank"
            + (f" (each row gives a rank's layer count; apply deals the layers out in model order over "
               f"all {len(pp.stages) * pp.virtual_stages} virtual stages, stage s on rank s % {ranks})"
               if per_rank else ""))
    return head + "\n" + table(["stage", f"{pp.dim} rank", "time", "modules"], [
        (s.index, s.index if per_rank else s.index % ranks, seconds(s.predicted_time_s),
         f"{s.modules[0]} .. {s.modules[-1]} ({len(s.modules)})" if len(s.modules) > 3 else ", ".join(s.modules))
        for s in pp.stages])


def render_plan(plan: Plan) -> str:
    mesh = plan.mesh
    out = [f"{plan.model} on {plan.devices} {mesh.device_type} devices, profile {plan.profile}, "
           f"batch {plan.batch_size} x seq {plan.seq_len}, {plan.microbatches} micro-batch(es), "
           f"checkpointing {plan.activation_checkpointing}"]
    dims = []
    for d in mesh.dims:
        mode = plan.dp_mode(d.name)
        dims.append(f"{d.name}={d.size}" + (f" ({mode})" if mode else ""))
    out.append("mesh: " + " x ".join(dims) + "   (row-major: the last dim holds adjacent ranks)")

    rows = []
    for p in plan.parameters:
        shape = plan.fingerprint.params.get(p.fqn)
        words = [placement_word(plan, p.fqn, shape, d.name, pl) for d, pl in zip(mesh.dims, p.placements, strict=True)]
        rows.append([p.fqn, shape if shape is not None else "?", plan.fingerprint.counts.get(p.fqn, ""),
                     *words, _local_shape(plan, shape, p.placements)])
    out.append(table(["parameter", "shape", "x", *(f"{d.name}({d.size})" for d in mesh.dims), "local"], rows))

    if plan.modules:
        out.append(table(["module", "input", "output"], [
            (m.module, ",".join(m.input) if m.input else "-", ",".join(m.output) if m.output else "-")
            for m in plan.modules]))
    if plan.pipeline is not None:
        out.append(render_pipeline(plan))
    out.append(render_prediction(plan.prediction))

    chosen = {d.name: d.size for d in mesh.dims}
    s = plan.solver
    out.append(f"solver: {s.solver} {s.status}, {s.variables} variables, {s.constraints} constraints, "
               f"solve {seconds(s.solve_time_s)}, total {seconds(s.total_time_s)}, objective {s.objective:.6g}"
               + (f", gap {s.gap:.3g}" if s.gap is not None else ""))
    out.extend(f"note: {note}" for note in s.notes)
    if s.unsupported_ops:
        out.append("no sharding rule, priced as element-wise in their segment's layout: " + ", ".join(f"{k} x{v}" for k, v in s.unsupported_ops.items()))
    if s.alternatives:
        out.append(table(["", "alternative mesh", "step time", "peak memory", "fits", "note"], [
            ("*" if a.mesh == chosen and a.step_time_s == plan.prediction.time.step_time_s else "", " x ".join(f"{k}={v}" for k, v in a.mesh.items()),
             seconds(a.step_time_s), nbytes(a.peak_memory_bytes),
             "-" if a.skipped else "yes" if a.fits else "no", a.note)  # "-": never priced
            for a in s.alternatives]))
    return "\n\n".join(out)
