"""lantern tune's record and command: the record round-trips, a corrupt one or one from another
machine is refused in one line, Ctrl-C while it is written leaves none half-written, the tuned
tree is found by name, the measured images take the classes in turn, and the command on a bundle
prints its table and writes its record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.families.loading import open_bundle, open_model_dir
from lantern_rt.run_options import RunOptions
from lantern_rt.runtime.tree import build_tree, load_tree
from lantern_rt.settings import MethodConfig, resolve
from lantern_rt.tune import record as records
from lantern_rt.tune.acceptance import AcceptanceTable
from lantern_rt.tune.costs import MAX_ROUNDS, MIN_ROUNDS, CostModel, CostRounds, StepCost, batch_drain
from lantern_rt.tune.dp import fastest_tree
from lantern_rt.tune.record import (
    RecordError,
    named_tree,
    read_record,
    record_path,
    this_machine,
    write_record,
)
from lantern_rt.tune.session import Candidate, DecodeRun
from lantern_rt.tune.tuner import DRAFTER_TREES, SEED, WINDOW_TREES, Progress, TuneOptions, Tuner
from tests.conftest import tiny_vq
from tests.test_export import make_bundle

HERE = this_machine("onnxruntime", "onnxruntime")
RECORD = {
    "machine": HERE,
    "batch_sizes": {"1": {"choice": {"label": "lantern++ tuned"}}},
    "tuned_trees": {"tuned": [[0], [1], [0, 0]]},
}


def test_a_record_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "tuning.json"
    write_record(path, RECORD)
    data = read_record(path, HERE)
    assert {k: data[k] for k in RECORD} == json.loads(json.dumps(RECORD))
    assert records.record_tree(data, path).paths == ((0,), (1,), (0, 0))
    assert load_tree(str(records.tree_file(path))).paths == ((0,), (1,), (0, 0))  # --tree FILE
    write_record(path, {**RECORD, "tuned_trees": {}})  # AR everywhere: no tree file left
    assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.json"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\x00\xffnot json", "is corrupt (not JSON)"),
        (b'{"format": "lantern-rt-tuning", "version": 1}', "is corrupt (no machine"),
        (b'{"format": "something else"}', "is not a tuning record"),
        (b'{"format": "lantern-rt-tuning", "version": 99}', "of version 99"),
    ],
)
def test_a_corrupt_record_is_refused_in_one_line(tmp_path: Path, body: bytes, says: str) -> None:
    path = tmp_path / "tuning.json"
    path.write_bytes(body)
    with pytest.raises(RecordError, match=re.escape(says)) as err:
        read_record(path, HERE)
    assert "\n" not in str(err.value)


def test_a_record_of_another_machine_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    other = {**HERE, "cpu": "Another CPU", "versions": {**HERE["versions"], "onnxruntime": "0.0.1"}}
    write_record(path, {**RECORD, "machine": other})
    with pytest.raises(
        RecordError, match="another machine or version: cpu 'Another CPU'.*onnxruntime 0.0.1"
    ) as err:
        read_record(path, HERE)
    assert "\n" not in str(err.value)
    assert read_record(path)["machine"]["cpu"] == "Another CPU"  # read as it is when no machine is asked


def test_ctrl_c_while_writing_leaves_no_half_written_record(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "tuning.json"
    write_record(path, RECORD)
    before = path.read_bytes()
    real = Path.write_bytes

    def interrupted(self: Path, data: bytes) -> int:
        real(self, data[: len(data) // 2])  # half of it on disk, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_record(path, {**RECORD, "tuned_trees": {}})
    monkeypatch.undo()
    assert path.read_bytes() == before  # the old record, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tuning.json",
        "tuning.tuned.json",
    ]  # no temporary file
    fresh = tmp_path / "new.json"
    monkeypatch.setattr(Path, "write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_record(fresh, RECORD)
    assert not fresh.exists()


def test_the_tuned_tree_is_found_by_name(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))  # the record stays this test's
    md = open_model_dir(tiny_model_dir)
    with pytest.raises(RecordError, match="no onnxruntime tuning record for .*run 'lantern tune"):
        named_tree("tuned", md, "onnxruntime")
    assert named_tree("chain-3", md, "onnxruntime").paths == load_tree("chain-3").paths
    write_record(record_path(md, "onnxruntime"), RECORD)
    assert named_tree("tuned", md, "onnxruntime").paths == ((0,), (1,), (0, 0))
    assert named_tree("tuned", md, "onnxruntime").name == "tuned"


@pytest.fixture(scope="module")
def bundle(trained_pair, tmp_path_factory) -> Path:
    """test_calibrate's bundle (the trained pair, chain-3; exported once per run)."""
    target, drafter = trained_pair
    return make_bundle(
        tmp_path_factory.mktemp("tune") / "fp32", target, tiny_vq(), drafter, ["chain-3"], "fp32"
    )


@pytest.mark.slow  # the bundle is an export (test_calibrate's: shared within a run)
def test_tune_on_a_bundle_prints_its_table_and_writes_its_record(bundle: Path) -> None:
    result = CliRunner().invoke(
        main, ["tune", str(bundle), "--images", "2", "--calibration-images", "2", "-q"]
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "| B = 1 |" in out and "lantern++ chain-3" in out and "| ar" in out
    data = read_record(bundle / "tuning.json", this_machine("onnxruntime", "onnxruntime"))
    rows = data["batch_sizes"]["1"]["candidates"]
    measured = [r for r in rows if r["measured_s_per_image"] is not None]
    assert {r["label"] for r in measured} >= {"ar", "lantern++ chain-3"}
    assert all(r["predicted_s_per_image"] > 0 for r in measured)
    tables = data["acceptance"]["lantern++ k=10 lambda=5.0"]
    assert tables["tests"][0][0] > 0 and len(tables["tests"]) == 3  # chain-3: three depths counted
    assert data["batch_sizes"]["1"]["choice"]["label"] in {r["label"] for r in measured}
    open_bundle(bundle)  # the record beside it leaves the bundle as it was


def test_export_of_the_tuned_tree_without_a_record_is_one_line_exit_2(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bundle"
    args = ["export", "--model", str(tiny_model_dir), "--tree", "tuned", "--out", str(out), "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert (
        result.output.startswith("error: no onnxruntime tuning record for") and result.output.count("\n") == 1
    )
    assert not out.exists()


def _cost(
    label: str, tree: str | None, verify: float, draft: float, host: float, spread: float = 0.0
) -> StepCost:
    shape = load_tree(tree) if tree else None
    nodes, depth = (shape.num_nodes, shape.max_depth) if shape else (0, 0)
    return StepCost(label, nodes, depth, False, verify, draft, host, 0.01, 1.0, spread, 2)


def test_the_cost_model_runs_through_its_measurements() -> None:
    def draft(depth: int, nodes: int) -> float:  # a planted plane the fit must find
        return 0.002 + 0.001 * depth + 0.0001 * nodes

    trees = ["chain-3", "chain-5", "mc_sim_7b_63", "naive_extend_57"]
    measured = [_cost("ar", None, 0.004, 0.0, 0.001)]
    for name in trees:
        t = load_tree(name)
        measured.append(
            _cost(name, name, 0.004 + 0.0005 * t.num_nodes, draft(t.max_depth, t.num_nodes), 0.002, 0.1)
        )
    model = CostModel(8, tuple(measured))
    assert model.max_nodes == 57
    assert model.verify(1) == pytest.approx(0.004) and model.verify(6) == pytest.approx(0.0065)
    assert model.verify(16) == pytest.approx(0.004 + 0.0005 * 15)  # between chain-5 and mc_sim: linear
    probe = load_tree("chain-8")
    assert model.step(probe) == pytest.approx(0.004 + 0.0005 * 8 + draft(8, 8) + 0.002)
    ar = model.seconds_per_image(None, 1.0, 256)
    assert ar == pytest.approx(255 * 0.005 / 8 + 0.01)  # AR's images end together: no drain
    drained = model.seconds_per_image(probe, 4.0, 256)
    assert drained == pytest.approx(255 / 4 * (1 + 0.1 * batch_drain(8)) * model.step(probe) / 8 + 0.01)
    assert batch_drain(1) == 0 and 1.3 < batch_drain(8) < 1.5 and batch_drain(64) > batch_drain(8)


def test_cost_rounds_stop_once_settled() -> None:
    seconds = {"steady": [1.0] * 9, "jumpy": [1.0, 2.0] * 5}

    def decode(candidate: Candidate, round_: int) -> DecodeRun:
        run = DecodeRun(1, seconds["steady" if candidate.tree is None else "jumpy"][round_] * 10)
        run.calls["verify"].extend([0.5] * 10)
        run.committed.extend([1] * 10)
        run.image_steps.append(10)
        return run

    rounds = []
    cost_rounds = CostRounds(
        1, [Candidate(MethodConfig("ar")), Candidate(MethodConfig("exact"), load_tree("chain-2"))], decode
    )
    cost_rounds.settle(lambda: rounds.append(1))
    costs = cost_rounds.model().measured
    assert [c.rounds for c in costs] == [MIN_ROUNDS, MAX_ROUNDS]
    assert len(rounds) == MAX_ROUNDS and costs[0].step == pytest.approx(1.0)


class _SlowingMachine:
    """A session whose decodes take twice as long once a decode of seed ``slow_at`` starts (a
    load that arrives during a tune): each image of 255 steps of one token, its calls' seconds
    planted."""

    def __init__(self, slow_at: int) -> None:
        self.decodes, self.slow_at, self.slow = 0, slow_at, False

    def decode(self, candidate: Candidate, batch: int, images: int, seed: int) -> DecodeRun:
        self.decodes += 1
        self.slow = self.slow or seed == self.slow_at
        pace = 2.0 if self.slow else 1.0
        nodes = candidate.tree.num_nodes if candidate.tree else 0
        verify, draft, host, prefill = (
            0.001 * (1 + nodes) * pace,
            0.001 * nodes * pace,
            0.0005 * pace,
            0.01 * pace,
        )
        run = DecodeRun(images, images * (255 * (verify + draft + host) + prefill))
        run.calls["verify"].extend([verify] * 255 * images)
        run.calls["draft"].extend([draft] * 255 * images if nodes else [])
        run.calls["prefill"].extend([prefill] * images)
        run.committed.extend([1] * 255 * images)
        run.image_steps.extend([255] * images)
        return run


def test_predictions_follow_a_machine_that_slows_down_during_the_measurement(monkeypatch) -> None:
    monkeypatch.setattr(Progress, "tick", lambda self, what: None)
    tuner = Tuner(open_model_dir(None), TuneOptions((MethodConfig("lantern++"),)))
    lantern = MethodConfig("lantern++")
    named = [Candidate(MethodConfig("ar")), Candidate(lantern, load_tree("chain-3"))]
    machine = _SlowingMachine(slow_at=SEED + 3000 + 4)  # half speed from the fifth of 8 slices on
    rounds = CostRounds(1, named, lambda candidate, round_: machine.decode(candidate, 1, 1, round_))
    rounds.settle(lambda: None)
    rows = tuner._measure([(c, machine, None, False) for c in named], 1, rounds, 8)
    for row in rows:
        assert row.seconds_per_image == pytest.approx(row.measured_seconds_per_image, rel=0.15)
        assert row.seconds_per_image_at_search < 0.7 * row.measured_seconds_per_image  # the old clock
        assert row.to_json()["predicted_s_per_image_at_search"] == row.seconds_per_image_at_search
    assert machine.decodes == len(named) * (MIN_ROUNDS + 8 * 2)  # a cost round after each slice
    assert [c.rounds for c in rounds.model().measured] == [MIN_ROUNDS + 8] * len(named)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_the_measured_images_take_the_classes_in_turn(batch: int, monkeypatch) -> None:
    """Each candidate's measured images at B > 1 are the run's images 0, 1, ... (each class of
    the demo once at the default 10), not images 0..B-1 from a new seed per slice (classes
    0, 1, 1, 2, ... at B = 2)."""
    monkeypatch.setattr(Progress, "tick", lambda self, what: None)
    tuner = Tuner(open_model_dir(None), TuneOptions((MethodConfig("lantern++"),)))
    classes = tuner.info.gpt.num_classes
    machine, decoded = _SlowingMachine(slow_at=-1), []

    def decode(candidate: Candidate, batch: int, images: int, seed: int) -> DecodeRun:
        decoded.extend((seed + i) % classes for i in range(images))  # session.decode's classes
        return _SlowingMachine.decode(machine, candidate, batch, images, seed)

    machine.decode = decode  # type: ignore[method-assign]
    ar = [Candidate(MethodConfig("ar"))]
    rounds = CostRounds(
        batch, ar, lambda candidate, round_: _SlowingMachine(-1).decode(candidate, batch, batch, 0)
    )
    rounds.settle(lambda: None)
    tuner._measure([(ar[0], machine, None, False)], batch, rounds, TuneOptions(()).images // batch)
    assert sorted(decoded) == list(range(classes))


def test_a_chain_between_the_measured_ones_is_costed_between_them() -> None:
    """Costs measured on the demo (ms, B = 1, 73d7972's run): naive_extend_57's drafting and host
    far above a plane through the others; chain-6 must cost between chain-5 and chain-8."""
    measured = [
        _cost("ar", None, 1.004e-3, 0.0, 0.184e-3),
        _cost("chain-3", "chain-3", 2.089e-3, 1.197e-3, 0.289e-3),
        _cost("chain-5", "chain-5", 2.277e-3, 1.457e-3, 0.316e-3),
        _cost("chain-8", "chain-8", 2.823e-3, 1.990e-3, 0.385e-3),
        _cost("mc_sim_7b_63", "mc_sim_7b_63", 6.334e-3, 2.513e-3, 0.742e-3),
        _cost("naive_extend_57", "naive_extend_57", 24.311e-3, 11.278e-3, 5.797e-3),
    ]
    model = CostModel(1, tuple(measured))
    five, six, eight = (model.step(load_tree(f"chain-{d}")) for d in (5, 6, 8))
    assert five < six < eight and six == pytest.approx(five + (eight - five) / 3, rel=0.05)


@pytest.mark.parametrize(
    ("jacobi", "trees"),
    [(False, list(DRAFTER_TREES)), (True, list(WINDOW_TREES))],
)
def test_the_search_keeps_to_the_shapes_the_cost_rounds_measured(jacobi: bool, trees: list[str]) -> None:
    """Drafting and host costs that rise steeply with the depth: the plane fitted over the named
    trees runs to 0 below depth 3, which would make a one- or two-node tree the fastest."""

    def cost(name: str) -> StepCost:
        t = load_tree(name)
        overhead = 0.004 * t.max_depth - 0.008
        return StepCost(
            name,
            t.num_nodes,
            t.max_depth,
            jacobi,
            0.004,
            0.0 if jacobi else overhead,
            overhead,
            0.01,
            1.0,
            0.0,
            3,
        )

    model = CostModel(
        1, (StepCost("ar", 0, 0, False, 0.004, 0.0, 0.001, 0.01, 1.0, 0.0, 3), *map(cost, trees))
    )
    depths = [load_tree(name).max_depth for name in trees]
    nodes = [load_tree(name).num_nodes for name in trees]
    table = AcceptanceTable("planted", [[100] * 4] * 8, [[50, 20, 10, 5]] * 8)
    method = MethodConfig("sjd" if jacobi else "lantern++")
    tuner = Tuner(open_model_dir(None), TuneOptions((method,)))
    tree = tuner._search(model, table, jacobi).tree
    assert min(depths) <= tree.max_depth <= max(depths) and min(nodes) <= tree.num_nodes <= max(nodes)
    assert model.covers(tree, jacobi) and not model.covers(load_tree("chain-1"), jacobi)
    if not jacobi:  # extrapolated, the plane would have favoured a shallower tree
        free = fastest_tree(table.probabilities(), model.step, 63, 8, 4)
        assert free.tree.max_depth < min(depths)
    assert set(model.curves()["draft_seconds_per_depth"]) == (set() if jacobi else set(range(3, 9)))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["{missing}"], "model directory not found"),
        (["{model}", "--batch-size", "0"], "batch sizes must be"),
        (["{model}", "--method", "exact"], "--method exact drafts with a drafter"),
        (["{model}", "--method", "sjd++", "--lantern-lambda", "0.5"], "lambda must be"),
        (["{model}", "--method", "lantern++", "--coupling", "gumbel"], "--coupling sets how"),
    ],
)
def test_bad_input_to_tune_is_one_line_exit_2(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, args, says
) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    given = [a.format(missing=tmp_path / "none", model=tiny_model_dir) for a in args]
    result = CliRunner().invoke(main, ["tune", *given, "-q"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and says in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "cache").exists()  # refused before any export


def _choice(label: str, method: str, tree: dict | None) -> dict:
    return {"choice": {"label": label, "method": method, "tree": tree, "measured_s_per_image": 0.25}}


TUNED_PATHS = [[0], [0, 0], [0, 0, 0], [1]]
CHOICES = {
    "1": _choice("lantern++ tuned", "lantern++", {"name": "tuned", "paths": TUNED_PATHS}),
    "2": _choice("lantern++ chain-3", "lantern++", {"name": "chain-3", "paths": [[0], [0, 0], [0, 0, 0]]}),
    "8": _choice("ar", "ar", None),
}


@pytest.fixture
def demo(tmp_path: Path, monkeypatch):
    """The demo with a tuning record of this machine (onnxruntime) in a cache of the test's own."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    md = open_model_dir(None)
    record = {"machine": HERE, "batch_sizes": CHOICES, "tuned_trees": {"tuned": TUNED_PATHS}}
    write_record(record_path(md, "onnxruntime"), record)
    return md


def _resolved(md, capsys, **options):
    plan = resolve(md, RunOptions(**options))
    return plan.method.method, plan.method.tree, capsys.readouterr().err


def test_a_run_that_names_no_method_follows_the_record_of_this_machine(demo, capsys) -> None:
    method, tree, said = _resolved(demo, capsys)
    assert method == "lantern++" and load_tree(tree).paths == build_tree(TUNED_PATHS).paths
    assert said.count("\n") == 1 and "tuning record of this machine" in said and "lantern++ tuned" in said
    assert _resolved(demo, capsys, method="auto")[:2] == (method, tree)
    assert _resolved(demo, capsys, batch_size=2)[:2] == ("lantern++", "chain-3")
    assert _resolved(demo, capsys, batch_size=8)[0] == "ar"  # speculation did not pay there
    method, tree, said = _resolved(demo, capsys, batch_size=4)
    assert (method, tree) == ("lantern++", "chain-5") and "no choice for batch size 4" in said
    assert _resolved(demo, capsys, method="exact")[:2] == ("exact", "chain-5")  # an explicit method wins
    assert _resolved(demo, capsys, tree="chain-3")[:2] == ("lantern++", "chain-3")  # so does a tree
    method, tree, _ = _resolved(demo, capsys, tree="tuned")
    assert load_tree(tree).paths == build_tree(TUNED_PATHS).paths
    assert [t.paths for t in records.export_trees(demo, "onnxruntime", "onnxruntime")] == [
        build_tree(TUNED_PATHS).paths,
        ((0,), (0, 0), (0, 0, 0)),
    ]


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda path: path.write_bytes(b"{not json"), "is corrupt"),
        (
            lambda path: write_record(
                path, {"machine": {**HERE, "cpu": "Another CPU"}, "batch_sizes": CHOICES, "tuned_trees": {}}
            ),
            "another machine or version: cpu 'Another CPU'",
        ),
        (
            lambda path: write_record(
                path,
                {
                    "machine": HERE,
                    "batch_sizes": {"1": _choice("x", "lantern++", {"paths": 3})},
                    "tuned_trees": {},
                },
            ),
            "is corrupt (a choice's tree)",
        ),
        (
            lambda path: write_record(
                path,
                {
                    "machine": HERE,
                    "batch_sizes": {"1": _choice("x", "lantern++", {"name": "tuned-9", "paths": [[0]]})},
                },
            ),
            "unknown tree 'tuned-9'",
        ),
    ],
)
def test_a_record_of_another_machine_or_corrupt_is_ignored_in_one_line(demo, capsys, spoil, says) -> None:
    spoil(record_path(demo, "onnxruntime"))
    method, tree, said = _resolved(demo, capsys)
    assert (method, tree) == ("lantern++", "chain-5")  # today's defaults
    assert said.startswith("warning: ignored:") and says in said and said.count("\n") == 1
