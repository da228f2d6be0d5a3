"""``lantern info``: what a bundle, a model directory or a published model needs in memory on a
device (:mod:`lantern_rt.memory_plan`), and which devices it fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from lantern_rt.errors import UserError, reports_errors

MODEL_OPTIONS = ("--tree", "--batch-size", "--cache-windows", "--no-guidance", "--precision")


@click.command("info")
@click.argument("source")
@click.option(
    "--device",
    "device_key",
    default=None,
    help="Only this device (its source and reserve shown): "
    "orin-nano-8gb, orin-nx-16gb, agx-orin-64gb, rtx-4090, h100-80gb. Default: every one.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes) instead of tables.")
@click.option(
    "--tree",
    "trees",
    multiple=True,
    help="A model's export: its trees (repeatable). Default: "
    "the GPU's (naive_extend_57) with a drafter, chain-5 (a Jacobi window) without.",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    default=None,
    help="A model's export: images per call, comma-separated (default 1).",
)
@click.option(
    "--cache-windows",
    "windows",
    type=int,
    default=None,
    help="A model's export: cache windows per step graph (default 4, as `lantern export`).",
)
@click.option("--no-guidance", is_flag=True, help="A model's export: one row per image (--cfg-scale 1 only).")
@click.option(
    "--precision",
    "precisions",
    multiple=True,
    help="A model's precisions (repeatable): fp32, fp16, int8, w8a16, w4a16. Default: all.",
)
@reports_errors
def info_cmd(source, device_key, as_json, trees, batch_sizes, windows, no_guidance, precisions):
    """What SOURCE needs in memory on a device, and which devices it fits.

    SOURCE is a bundle (its graphs, and the plans built beside it), a model directory (the
    bundle `lantern export` would write, from its config.json alone) or a published model by
    name: llamagen-b, llamagen-l, llamagen-xl, llamagen-xxl, anole-7b, lumina-mgpt-7b-768."""
    from lantern_rt.devices import DEVICES, device_named

    devices = [device_named(device_key)] if device_key is not None else list(DEVICES)
    given = [
        o
        for o, v in zip(MODEL_OPTIONS, (trees, batch_sizes, windows, no_guidance, precisions), strict=True)
        if v not in (None, (), False)
    ]
    plan = source_plan(source, given, trees, batch_sizes, windows, no_guidance, precisions)
    if as_json:
        click.echo(json.dumps(plan_json(plan, devices), indent=1))
    else:
        for line in plan_lines(plan, devices, detailed=device_key is not None):
            click.echo(line)


def source_plan(source, given, trees, batch_sizes, windows, no_guidance, precisions):
    """The memory plan of ``source``: a bundle, a model directory or a published model's name."""
    from lantern_rt.bundle import MANIFEST
    from lantern_rt.cli.options import parse_batch_sizes
    from lantern_rt.families.loading import open_bundle
    from lantern_rt.memory_plan import PRECISIONS, bundle_plan, dir_model, model_layout, model_plan
    from lantern_rt.reference_models import REFERENCE_MODELS
    from lantern_rt.runtime.run_shape import CACHE_WINDOWS, check_cache_windows
    from lantern_rt.settings import CPU_DEFAULT_TREE, GPU_DEFAULT_TREE

    path = Path(source)
    if (path / MANIFEST).is_file():
        if given:
            raise UserError(
                f"{', '.join(given)} describe a model's export; a bundle's are its own: drop them"
            )
        return bundle_plan(open_bundle(path))
    if path.is_dir() and (path / "config.json").is_file():
        model, kind = dir_model(path), "model directory"
    elif source in REFERENCE_MODELS and not path.exists():
        model, kind = REFERENCE_MODELS[source](), "published shapes"
    else:
        raise UserError(
            f"{source} is not a bundle (no {MANIFEST}), a model directory (no config.json) or a known "
            f"model ({', '.join(REFERENCE_MODELS)})"
        )
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise UserError(f"unknown precision {unknown[0]!r}: choose from {', '.join(PRECISIONS)}")
    trees = trees or ((GPU_DEFAULT_TREE if model.drafter_layers else CPU_DEFAULT_TREE),)
    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else [1]
    count = check_cache_windows(CACHE_WINDOWS if windows is None else windows)
    layout = model_layout(model, trees, sizes, count, guided=not no_guidance)
    return model_plan(model, layout, kind, source, precisions or tuple(PRECISIONS))


# -- rendering ----------------------------------------------------------------------------------


def size(n: float | None) -> str:
    """Bytes in binary units: MiB below a GiB, else GiB."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plan_lines(plan, devices, detailed: bool = False) -> list[str]:
    """The plan as tables: the model, its weights per precision, each precision's plans, caches
    and activations, and for each device and batch size whether it fits."""
    from lantern_rt.plan_sizes import PLAN_MODEL

    m, layout = plan.model, plan.layout
    c = m.gpt
    lines = [
        f"{m.name}: {plan.source} {plan.where} ({m.family} {c.model_type}: {c.n_layer} layers, dim {c.dim}, "
        f"vocab {c.vocab_size}, {c.block_size} tokens after {c.cls_token_num} condition slot(s))",
        "parameters  "
        + ", ".join(f"{k.replace('_', ' ')} {v / 1e6:.2f} M" for k, v in plan.parameters.items() if v),
        "weights     one copy: " + ", ".join(f"{p} {size(b)}" for p, b in plan.weights.items()),
        f"export      trees {', '.join(t.name for t in layout.trees) or '-'}; batch sizes "
        f"{', '.join(map(str, layout.batch_sizes))}; cache windows {', '.join(map(str, layout.windows))} "
        f"of {layout.capacity} slots; {2 if layout.guided else 1} row(s) per image",
        f"plans       {PLAN_MODEL}" + (f"; built: engines/{plan.built_from}" if plan.built_from else ""),
        *(f"            {note}" for note in plan.notes),
        "",
    ]
    batches = layout.batch_sizes
    head = f"{'precision':<10} {'graphs':>6} {'plans':>11}"
    head += "".join(f" {f'KV b={b}':>11} {f'activ. b={b}':>11} {f'need b={b}':>11}" for b in batches)
    lines += [head + f" {'neighbours':>11} {'build peak':>11}"]
    for name, p in plan.precisions.items():
        if p.refused:
            lines.append(f"{name:<10} {p.refused}")
            continue
        row = f"{name:<10} {len(p.graphs):>6} {size(sum(g.size for g in p.graphs)):>11}"
        for b in batches:
            activations = sum(g.activations for g in p.loaded(b))
            row += f" {size(sum(p.kv[b])):>11} {size(activations):>11} {size(p.need(b)):>11}"
        lines.append(row + f" {size(p.neighbours):>11} {size(p.build_peak()):>11}")
    only = next(iter(plan.precisions.values()))
    if len(plan.precisions) == 1 and not only.refused:
        lines += ["", *graph_lines(only)]
    lines += ["", *device_lines(plan, devices, detailed)]
    return lines


def graph_lines(p) -> list[str]:
    """One precision's plans, graph by graph."""
    lines = [f"{'graph':<26} {'weights':>11} {'kernels':>7} {'predicted':>11} {'built':>11} {'error':>7}"]
    for g in p.graphs:
        error = f"{(g.predicted / g.built - 1) * 100:+.1f}%" if g.built else ""
        lines.append(
            f"{g.shape.name:<26} {size(g.weights):>11} {g.kernels:>7} {size(g.predicted):>11} {size(g.built):>11} {error:>7}"
        )
    return lines


def device_lines(plan, devices, detailed: bool) -> list[str]:
    """Per device, its usable memory and, per precision and batch size, whether a run fits."""
    columns = [(p, b) for p in plan.precisions for b in plan.layout.batch_sizes]
    lines = [f"{'device':<26} {'usable':>10} " + " ".join(f"{f'{p} b={b}':>12}" for p, b in columns)]
    for d in devices:
        cells = []
        for p, b in columns:
            fits = plan.fits(d, p, b)
            cells.append(f"{'-' if fits is None else 'fits' if fits else 'no':>12}")
        lines.append(f"{d.name:<26} {size(d.usable):>10} " + " ".join(cells))
        if detailed:
            lines += [
                f"  memory {size(d.memory)}: {d.source}",
                f"  reserved {size(d.reserved)}: {d.reserved_for}",
                f"  compute capability {d.compute_capability}: {d.tensorrt}",
            ]
    lines.append(
        "usable: the maker's memory less this table's reserve (lantern_rt/devices.py; --device shows both)"
    )
    return lines


def plan_json(plan, devices) -> dict[str, Any]:
    """The plan as JSON data (sizes in bytes)."""
    from lantern_rt.plan_sizes import PLAN_MODEL

    m, layout = plan.model, plan.layout
    return {
        "source": {"kind": plan.source, "where": plan.where, "built_from": plan.built_from},
        "model": {
            "name": m.name,
            "family": m.family,
            "model_type": m.gpt.model_type,
            "layers": m.gpt.n_layer,
            "dim": m.gpt.dim,
            "vocab_size": m.gpt.vocab_size,
            "image_tokens": m.gpt.block_size,
            "condition_slots": m.gpt.cls_token_num,
            "drafter_layers": m.drafter_layers,
        },
        "parameters": plan.parameters,
        "weights": plan.weights,
        "export": {
            "trees": [t.name for t in layout.trees],
            "batch_sizes": list(layout.batch_sizes),
            "cache_capacity": layout.capacity,
            "cache_windows": list(layout.windows),
            "rows_per_image": 2 if layout.guided else 1,
        },
        "plan_model": PLAN_MODEL,
        "precisions": {name: precision_json(p) for name, p in plan.precisions.items()},
        "devices": [
            {
                "key": d.key,
                "name": d.name,
                "compute_capability": d.compute_capability,
                "memory": d.memory,
                "usable": d.usable,
                "source": d.source,
                "reserved_for": d.reserved_for,
                "tensorrt": d.tensorrt,
                "fits": {
                    p: {str(b): plan.fits(d, p, b) for b in layout.batch_sizes} for p in plan.precisions
                },
            }
            for d in devices
        ],
    }


def precision_json(p) -> dict[str, Any]:
    """One precision's plans, caches, activations and needs."""
    if p.refused:
        return {"refused": p.refused}
    return {
        "graphs": [
            {
                "name": g.shape.name,
                "kind": g.shape.kind,
                "batch": g.shape.batch,
                "weights": g.weights,
                "kernels": g.kernels,
                "predicted": g.predicted,
                "built": g.built,
                "activations": g.activations,
            }
            for g in p.graphs
        ],
        "plans": sum(g.size for g in p.graphs),
        "kv_cache": {str(b): {"target": t, "drafter": d} for b, (t, d) in p.kv.items()},
        "neighbours": p.neighbours,
        "activations": {str(b): sum(g.activations for g in p.loaded(b)) for b in p.kv},
        "need": {str(b): p.need(b) for b in p.kv},
        "build_peak": p.build_peak(),
    }
