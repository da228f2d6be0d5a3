"""``lantern tune``'s table: each candidate's predicted and measured s/image per batch size, the
choices, the tuned trees and where the record is (the command prints it, the GPU check keeps it)."""

from __future__ import annotations

from lantern_rt.eval.report import markdown_table
from lantern_rt.tune.record import tree_file
from lantern_rt.tune.tuner import TuneResult


def report(result: TuneResult) -> list[str]:
    """The candidate table per batch size, the choices, the tuned tree and where the record is."""
    record = result.record
    machine = record["machine"]
    settings = record["settings"]
    threads = settings["threads"] or "default"
    lines = [
        f"lantern tune: {record['model']['name']} on {machine['backend']}, {machine['cpu']} "
        f"({machine['cores']} cores{', ' + machine['gpu'] if machine['gpu'] else ''}), threads {threads}, one stream"
    ]
    for b, choice in result.choices.items():
        rows = [r for r in result.rows if r.batch_size == b]
        ar = next(r for r in rows if r.tree is None and r.method == "ar")
        cells = []
        for r in rows:
            if r.skipped:
                cells.append([r.label, "", "", "", "", "", "", "", f"skipped: {r.skipped}"])
                continue
            shape = "" if r.tree is None else f"{r.tree.num_nodes}/{r.tree.max_depth}"
            error = (r.seconds_per_image / r.measured_seconds_per_image - 1) * 100
            speed = ar.measured_seconds_per_image / r.measured_seconds_per_image
            same = next(
                (
                    o.label
                    for o in rows
                    if o.tuned != r.tuned and o.tree and r.tree and o.tree.paths == r.tree.paths
                ),
                None,
            )
            mark = (f" (= {same.split()[-1]})" if r.tuned and same else "") + (
                " (chosen)" if r is choice else ""
            )
            cells.append(
                [
                    r.label + mark,
                    shape,
                    f"{r.tokens_per_step:.2f}",
                    f"{r.measured_tokens_per_step:.2f}",
                    f"{r.seconds_per_image:.4f}",
                    f"{r.seconds_per_image_at_search:.4f}",
                    f"{r.measured_seconds_per_image:.4f}",
                    f"{error:+.0f}%",
                    f"{speed:.2f}x",
                ]
            )
        headers = [
            f"B = {b}",
            "nodes/depth",
            "tau pred",
            "tau meas",
            "s/img pred",
            "at search",
            "s/img meas",
            "pred err",
            "vs AR",
        ]
        lines += ["", markdown_table(headers, cells)]
    lines.append("")
    for b, choice in result.choices.items():
        lines.append(
            f"B = {b}: {choice.label}, {choice.measured_seconds_per_image:.4f} s/image measured "
            f"({choice.seconds_per_image:.4f} predicted)"
        )
    for name, paths in record["tuned_trees"].items():
        lines.append(f"{name}: {paths} (lantern export --tree {tree_file(result.path, name)})")
    if record["tuned_trees"]:
        lines.append(
            "lantern export --tree tuned exports the first; a run with no --method and no --tree follows the choices"
        )
    lines += result.notes
    lines.append(f"record: {result.path} ({result.seconds:.0f} s)")
    return lines
