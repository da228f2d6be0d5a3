"""``lantern tune``."""

from __future__ import annotations

from pathlib import Path

import click

from lantern_rt.cli.options import parse_batch_sizes, run_option_type, threads_option
from lantern_rt.errors import UserError, reports_errors
from lantern_rt.settings import COUPLINGS, METHODS
from lantern_rt.tune import CALIBRATION_IMAGES, MAX_ROUNDS, MEASURED_IMAGES

SPECULATIVE = tuple(m for m in METHODS if m != "ar")


@click.command("tune")
@click.argument("source", metavar="[MODEL_OR_BUNDLE]", required=False, type=click.Path(path_type=Path))
@click.option(
    "--method",
    "methods",
    type=click.Choice(SPECULATIVE),
    multiple=True,
    help="Speculative method(s) to tune (repeatable); AR is always a candidate. Default: lantern++ "
    "when the model has a drafter, else sjd.",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    default="1",
    show_default=True,
    help="Images per step to tune for, comma-separated (e.g. 1,2,8): costs, tree and choice per size.",
)
@click.option(
    "--tree",
    "trees",
    multiple=True,
    help="Named tree(s) to measure beside the tuned one (repeatable). Default: chain-3, chain-5, "
    "chain-8, mc_sim_7b_63 and naive_extend_57 for a drafter, chain-5, chain-16 and pac-2-1-33 for "
    "sjd; a bundle's own trees for a bundle.",
)
@click.option(
    "--images",
    type=click.IntRange(min=1, max=10_000),
    default=MEASURED_IMAGES,
    show_default=True,
    help="Images measured per candidate and batch size, classes in turn (at least four batches above B = 1).",
)
@click.option(
    "--calibration-images",
    type=click.IntRange(min=1, max=10_000),
    default=CALIBRATION_IMAGES,
    show_default=True,
    help="Images decoded per method and calibration tree (classes in turn) to count how often each "
    "tree position is accepted.",
)
@click.option(
    "--max-rounds",
    type=click.IntRange(min=1, max=100),
    default=MAX_ROUNDS,
    show_default=True,
    help="Cost rounds per batch size before the tree search, at most (they stop sooner once the step "
    "costs settle): fewer make a quicker, rougher tune.",
)
@click.option("--lantern-k", "k", type=click.IntRange(min=0), default=10, show_default=True)
@click.option("--lantern-delta", "delta", type=float, default=0.1, show_default=True)
@click.option("--lantern-lambda", "lam", type=float, default=5.0, show_default=True)
@click.option("--coupling", type=click.Choice(COUPLINGS), default=None, help="A Jacobi method's coupling.")
@click.option(
    "--backend", type=run_option_type("backend"), default=None, help="Backend to tune. Default: the run's."
)
@click.option("--device", default="cpu", show_default=True, help="Where the backend computes.")
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=True,
    show_default=True,
    help="Replay each step from a captured CUDA graph, as the runs to come will (torch on a CUDA device).",
)
@threads_option("CPU threads (0: the engine's choice), as the runs to come will use.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@reports_errors
def tune_cmd(
    source,
    methods,
    batch_sizes,
    trees,
    images,
    calibration_images,
    max_rounds,
    k,
    delta,
    lam,
    coupling,
    backend,
    device,
    cuda_graphs,
    threads,
    quiet,
):
    """Measure this machine's step costs and the model's acceptance per tree position, find the
    fastest static tree (Sequoia's dynamic program), measure it beside every named tree and AR,
    and keep the fastest per batch size in a tuning record of the backend (beside a bundle, or in
    the export cache for a model directory; the built-in demo by default). The torch backend
    tunes a model directory as it is (no export)."""
    from lantern_rt.backends import backend_named
    from lantern_rt.bundle import MANIFEST
    from lantern_rt.families.loading import open_bundle, open_model_dir
    from lantern_rt.settings import MethodConfig, check_device
    from lantern_rt.tune.report import report
    from lantern_rt.tune.tuner import TuneOptions, tune

    check_device(device)
    is_bundle = source is not None and (source / MANIFEST).is_file()
    if is_bundle and backend is not None:
        backend_named(backend).check_bundle()  # before the bundle is read
    opened = open_bundle(source) if is_bundle else open_model_dir(source)
    has_drafter = opened.has_drafter if is_bundle else "drafter" in opened.files
    methods = methods or (("lantern++",) if has_drafter else ("sjd",))
    if coupling is not None and not any(m in ("sjd", "sjd++") for m in methods):
        raise UserError("--coupling sets how --method sjd or sjd++ draft: drop it or add --method sjd")
    configs = tuple(
        MethodConfig(m, k=k, delta=delta, lam=lam, coupling=coupling if m in ("sjd", "sjd++") else None)
        for m in dict.fromkeys(methods)
    )
    for config in configs:
        config.relaxation()  # k, delta and lambda checked before any work
    options = TuneOptions(
        configs,
        tuple(parse_batch_sizes(batch_sizes)),
        tuple(trees),
        images,
        calibration_images,
        threads or 0,
        backend,
        device,
        cuda_graphs,
        max_rounds,
    )
    with _Bar(quiet) as bar:
        result = tune(opened, options, bar)
    for line in report(result):
        click.echo(line)


class _Bar:
    """A tune's progress bar on stderr (tqdm), one step per measurement."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.bar = quiet, None

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def start(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="tune", unit="step", disable=self.quiet)

    def tick(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update()
