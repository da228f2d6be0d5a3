"""Faults while writing: outputs all or nothing, refused export folders, the export cache's lock
and stale folders, hand-edited manifests, and runs killed part-way (issue 18)."""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lantern_rt.bundle import DIGEST, FORMAT, MANIFEST, Bundle, BundleError, manifest_digest, staged_bundle
from lantern_rt.cli import main
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.fileio import WriteError, write_together
from lantern_rt.settings import MethodConfig
from tests.test_export import shared_bundle

LANTERN = Path(sys.executable).with_name("lantern")


def generate(model: Path, *args: str):
    """``lantern generate`` in-process on the torch backend (no export)."""
    return CliRunner().invoke(main, ["generate", "-q", "--backend", "torch", "--model", str(model), *args])


def one_line(result) -> str:
    """The single ``error: ...`` line of a command that failed (exit 2, nothing else printed)."""
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    return result.output


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``path`` (a file or a folder) locked as a live writer does."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


# -- generate: the PNG, --save-tokens and --stats-json all or nothing -----------------------------


def failing(code: int, original=None):
    """A writer that writes part of its file, then fails with ``code`` (EROFS, ENOSPC, ...)."""

    def write(*args: Any, **kwargs: Any) -> None:
        path = next(a for a in args if isinstance(a, Path))
        if original is None:
            path.write_bytes(b"partial")
        else:
            original(path, "partial")
        raise OSError(code, os.strerror(code))

    return write


FAULTS = {"image-ENOSPC": ("g.png", errno.ENOSPC), "tokens-EACCES": ("t.npy", errno.EACCES)}
FAULTS["stats-EROFS"] = ("s.json", errno.EROFS)


@pytest.mark.parametrize("name, code", FAULTS.values(), ids=FAULTS)
def test_a_failed_write_leaves_none_of_the_outputs(tiny_model_dir, tmp_path, monkeypatch, name, code):
    out = tmp_path / "out"
    out.mkdir()
    (out / "g.png").write_bytes(b"the user's old image")
    if name == "g.png":
        monkeypatch.setattr("lantern_rt.images.write_png", failing(code))
    elif name == "t.npy":
        monkeypatch.setattr("lantern_rt.training.codes_files.write_codes_file", failing(code))
    else:
        write_text = Path.write_text
        fail = failing(code, write_text)

        def write_stats(path: Path, *args: Any, **kwargs: Any):
            return fail(path) if path.name.startswith(".s.json.") else write_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_stats)
    paths = [
        "-o",
        str(out / "g.png"),
        "--save-tokens",
        str(out / "t.npy"),
        "--stats-json",
        str(out / "s.json"),
    ]
    result = generate(tiny_model_dir, "-n", "1", *paths)
    assert one_line(result) == f"error: cannot write {out / name}: {os.strerror(code)}\n"
    assert [p.name for p in out.iterdir()] == ["g.png"]  # no new file, no temporary one
    assert (out / "g.png").read_bytes() == b"the user's old image"


def test_bench_writes_its_report_whole_or_not_at_all(tiny_model_dir, tmp_path, monkeypatch):
    """A plot that cannot be written: no results.json, results.md or other plot is left."""
    import lantern_rt.eval.report as report

    class Unwritable:
        def save(self, path, format=None):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report, "accepted_lengths", lambda rows: Unwritable())
    out = tmp_path / "bench"
    args = ["bench", "--model", str(tiny_model_dir), "--backend", "torch", "--config", "ar", "-n", "1"]
    result = CliRunner().invoke(main, [*args, "--warmup", "0", "--no-quality", "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output  # after the run's progress bars
    last = result.output.splitlines()[-1]
    assert last == f"error: cannot write {out / 'accepted_lengths.png'}: {os.strerror(errno.ENOSPC)}"
    assert list(out.iterdir()) == []


def test_train_drafter_writes_the_drafter_and_its_config_together(tiny_model_dir, tmp_path, monkeypatch):
    import numpy as np

    def full(tensors, path):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    np.savez(tmp_path / "c.npz", codes=np.arange(32).reshape(2, 16) % 64, labels=np.array([0, 1]))
    monkeypatch.setattr("safetensors.torch.save_file", full)
    out = tmp_path / "d"
    args = ["train-drafter", "--model", str(tiny_model_dir), "--codes", str(tmp_path / "c.npz")]
    result = CliRunner().invoke(main, [*args, "--out", str(out), "--steps", "1", "--batch", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output  # after its progress bar
    assert result.output.splitlines()[-1].startswith(f"error: cannot write {out / 'drafter.safetensors'}")
    assert sorted(p.name for p in out.iterdir()) == ["train_state.pt"]  # the resumable state only


def test_a_failed_rename_takes_back_the_files_already_moved(tmp_path, monkeypatch):
    replace, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    writes = {
        tmp_path / "a.txt": lambda p: p.write_text("a"),
        tmp_path / "b.txt": lambda p: p.write_text("b"),
    }
    with pytest.raises(WriteError, match=f"cannot write {tmp_path / 'b.txt'}: Read-only file system"):
        write_together(writes)
    assert list(tmp_path.iterdir()) == []


def test_stats_json_dash_is_the_only_thing_on_stdout(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = generate(tiny_model_dir, "-n", "1", "--class", "0", "-o", "g.png", "--stats-json", "-")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["num_images"] == 1 and stats["output"] == "g.png"
    assert "1 images (ar, torch)" in result.stderr and "{" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.png", "tiny"]


def test_outputs_that_name_one_file_twice_are_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    same = str(out / "x.npy")
    result = generate(tiny_model_dir, "-o", str(out / "g.png"), "--save-tokens", same, "--stats-json", same)
    assert one_line(result) == "error: -o, --save-tokens and --stats-json must name different files\n"
    assert list(out.iterdir()) == []


def test_a_killed_write_s_temporary_files_go_and_a_live_one_s_stay(tiny_model_dir, tmp_path):
    """Temporary files are ``.NAME.XXXXXXXX.SUFFIX``, locked while their writer lives: the next
    write of NAME removes those no one holds (a SIGKILLed run's) and nothing else."""
    stale, live, mine = (tmp_path / f".g.png.{tag}.png" for tag in ("dead0001", "live0001", "notes"))
    for path in (stale, live, mine):
        path.write_bytes(b"x")
    with locked(live):
        result = generate(tiny_model_dir, "-n", "1", "--class", "0", "-o", str(tmp_path / "g.png"))
        assert result.exit_code == 0, result.output
    assert not stale.exists() and live.exists() and mine.exists() and (tmp_path / "g.png").is_file()


# -- export: --out refused before any work --------------------------------------------------------


def user_folder(tmp_path: Path, manifest: str | None) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    if manifest is not None:
        (folder / MANIFEST).write_text(manifest)
    return folder


OUTS = {
    "a-file": (lambda t: t / "f.txt", [], "it is a file or a link, not a bundle folder"),
    "a-file-forced": (lambda t: t / "f.txt", ["--force"], "it is a file or a link, not a bundle folder"),
    "a-link": (lambda t: t / "link", ["--force"], "it is a file or a link"),
    "under-a-file": (lambda t: t / "f.txt" / "b", [], "f.txt is not a folder"),
    "refusing-file-system": (
        lambda t: Path("/proc/lantern-test/b"),
        [],
        "cannot write bundle /proc/lantern-test/b: ",
    ),
    "user-folder": (lambda t: user_folder(t, None), ["--force"], "it is not a lantern-rt bundle"),
    "other-manifest": (
        lambda t: user_folder(t, '{"format": "other"}'),
        ["--force"],
        "it is not a lantern-rt bundle",
    ),
    "broken-manifest": (lambda t: user_folder(t, "{"), ["--force"], "it is not a lantern-rt bundle"),
    "user-folder-unforced": (lambda t: user_folder(t, None), [], "already exists; choose another folder"),
}


@pytest.mark.parametrize("out, flags, says", OUTS.values(), ids=OUTS)
def test_export_refuses_a_bad_out_before_any_work(tiny_model_dir, tmp_path, monkeypatch, out, flags, says):
    (tmp_path / "f.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "f.txt")
    out = out(tmp_path)
    before = sorted(tmp_path.rglob("*"))

    def no_work(*args: Any, **kwargs: Any):
        raise AssertionError("the export started")

    monkeypatch.setattr("lantern_rt.export.exporter.load_target", no_work)
    result = CliRunner().invoke(
        main, ["export", "-q", "--model", str(tiny_model_dir), "--out", str(out), *flags]
    )
    assert says in one_line(result) and str(out) in result.output
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "f.txt").read_text() == "mine"
    if out.name == "mine":
        assert (out / "thesis.tex").read_text() == "years of work"


# -- the export cache ---------------------------------------------------------------------------


def test_a_cache_that_is_a_file_or_unwritable_is_one_line(tiny_model_dir, tmp_path):
    (tmp_path / "file").write_text("")
    for cache in (tmp_path / "file", Path("/proc/lantern-cache")):
        result = CliRunner().invoke(
            main,
            ["generate", "-q", "--model", str(tiny_model_dir), "-o", str(tmp_path / "g.png")],
            env={"LANTERN_CACHE": str(cache)},
        )
        assert one_line(result).startswith(f"error: cannot write the export cache {cache / 'bundles'}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "tiny"]


def test_a_checkpoint_that_fails_to_load_is_the_only_line(tiny_model_dir, tmp_path):
    (tiny_model_dir / "gpt.safetensors").write_bytes(b"not a checkpoint")
    cache = tmp_path / "cache"
    result = CliRunner().invoke(
        main,
        ["generate", "-q", "--model", str(tiny_model_dir), "-o", str(tmp_path / "g.png")],
        env={"LANTERN_CACHE": str(cache)},
    )
    assert "gpt.safetensors" in one_line(result) and "exporting" not in result.output
    assert not cache.exists()  # the model is refused before the cache's lock or folder is made


def fake_export(calls: list[Path]):
    """An export_bundle that writes a bare manifest through staged_bundle, as the real one does."""

    def export(md, out: Path, on_start=None, **kwargs: Any) -> Path:
        calls.append(out)
        on_start()
        with staged_bundle(out) as tmp:
            (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT}))
        return out

    return export


def test_the_cache_lock_makes_others_wait_and_reuse(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr("lantern_rt.export.exporter.export_bundle", fake_export(calls))
    md, method = open_model_dir(tiny_model_dir), MethodConfig("ar")
    out = cached_bundle(md, method)
    assert calls == [out] and cached_bundle(md, method) == out and calls == [out]  # then reused
    shutil.rmtree(out)
    stale, live = (out.with_name(f".{out.name}.{tag}.tmp") for tag in ("dead0001", "live0001"))
    stale.mkdir()
    (stale / "half.onnx").write_bytes(b"x")
    live.mkdir()
    lock = out.with_name(f".{out.name}.lock")
    got: list[Path] = []
    with locked(lock):  # another run is exporting: this one waits
        waiter = threading.Thread(target=lambda: got.append(cached_bundle(md, method)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and stale.exists()
        with locked(live):
            out.mkdir()  # ... and the other run's bundle arrives
            (out / MANIFEST).write_text(json.dumps({"format": FORMAT}))
    waiter.join(10)
    assert got == [out] and calls == [out]  # reused, not exported again
    shutil.rmtree(out)
    with locked(live):  # a live run's folder (locked) is never taken for stale
        assert cached_bundle(md, method) == out and calls == [out, out]
    assert not stale.exists() and live.exists()
    err = capsys.readouterr().err
    assert err.count("waiting for another run exporting tiny") == 1 and err.count("exporting tiny to") == 2


# -- hand-edited manifests ----------------------------------------------------------------------


@pytest.fixture
def bundle(tmp_path_factory, tmp_path) -> Path:
    """A copy of a tiny class-conditional bundle (tests/test_export.py's, exported once)."""
    copy_ = tmp_path / "copy"
    shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), copy_)
    return copy_


def edit(path: Path, change) -> dict[str, Any]:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_every_writer_records_the_manifest_digest(bundle):
    raw = json.loads((bundle / MANIFEST).read_text())
    assert raw[DIGEST] == manifest_digest(raw) and Bundle.open(bundle).manifest()[DIGEST] == raw[DIGEST]


EDITS = {
    "class-names": lambda m: m["class_names"].reverse(),
    "sampling-defaults": lambda m: m["sampling_defaults"].update(cfg_scale=9.0),
    "neighbors-k": lambda m: m["constants"]["neighbors"].update(k=1),
    "digest-removed": lambda m: m.pop(DIGEST),
    "digest-forged": lambda m: m.update({DIGEST: "0" * 64}),
}


@pytest.mark.parametrize("change", EDITS.values(), ids=EDITS)
def test_an_edited_manifest_is_refused(bundle, change):
    edit(bundle, change)
    with pytest.raises(
        BundleError, match=r"manifest\.json was edited \(its manifest_digest does not match\): re-export"
    ):
        Bundle.open(bundle)


def resign(path: Path, change) -> None:
    """Edit the manifest at ``path`` and recompute its digest, as someone who read the format
    would: the digest catches accidental edits, not these."""

    def edited(manifest: dict[str, Any]) -> None:
        change(manifest)
        manifest[DIGEST] = manifest_digest(manifest)

    edit(path, edited)


def _both(field: str, value: int):
    """Set ``field`` in the manifest's ``gpt`` and ``constants`` alike."""
    return lambda m: (m["gpt"].update({field: value}), m["constants"].update({field: value}))


# an edit, digest recomputed -> what the one line says: the manifest against its graphs
RESIGNED = {
    "num-classes-above-the-table": (
        lambda m: m["gpt"].update(num_classes=5000),
        r"gpt\.num_classes as 5000 \(class_dropout_prob [0-9.]+\), and graph target_prefill's class table has 6 rows",
    ),
    "the-null-class-as-a-class": (
        lambda m: (m["gpt"].update(num_classes=6), m["class_names"].append("null")),
        r"gpt\.num_classes as 6 \(class_dropout_prob [0-9.]+\), and graph target_prefill's class table has 6 rows",
    ),
    "the-null-class-id": (
        lambda m: m["constants"]["null_condition"].update(class_id=0),
        r"the null class as 0",
    ),
    "vocabulary": (
        _both("vocab_size", 128),
        r"constants\.vocab_size as 128, and graph target_prefill declares 64",
    ),
    "grid": (
        lambda m: (_both("block_size", 64)(m), m["constants"].update(grid_size=8)),
        r"constants\.block_size as 64, and graph vq_decode declares 16",
    ),
    "image-size": (lambda m: m.update(image_size=64), r"image_size as 64, and graph vq_decode declares"),
    "prefix-slots": (
        _both("cls_token_num", 3),
        r"constants\.cls_token_num as 3, and graph target_prefill declares 1",
    ),
    "rows-per-call": (
        lambda m: m["constants"].update(guided=False),
        r"rows per call \(constants\.batch_sizes, guided\) as 1, and graph target_prefill declares 2",
    ),
    "gpt-against-constants": (
        lambda m: m["gpt"].update(vocab_size=128),
        r"gpt\.vocab_size as 128 and constants\.vocab_size as 64",
    ),
}


@pytest.mark.parametrize("change, says", RESIGNED.values(), ids=RESIGNED)
def test_a_resigned_manifest_that_disagrees_with_its_graphs_is_one_line(bundle, tmp_path, change, says):
    resign(bundle, change)
    args = [
        "generate",
        "-q",
        "--bundle",
        str(bundle),
        "-n",
        "1",
        "--class",
        "4",
        "-o",
        str(tmp_path / "x.png"),
    ]
    line = one_line(CliRunner().invoke(main, args))
    assert re.search(says, line) and line.rstrip().endswith("re-export the bundle"), line
    assert not (tmp_path / "x.png").exists()


@pytest.fixture
def drafted(tmp_path_factory, tmp_path) -> Path:
    """A copy of a tiny bundle with a drafter and its chain-1 graphs (tests/test_export.py's)."""
    return Path(shutil.copytree(shared_bundle(tmp_path_factory, "t2i-gqa-fp16"), tmp_path / "drafted"))


TREE_EDITS = {
    "a-node-more": ([[0], [0, 0]], r"trees\.chain-1's nodes as 3, and graph draft_tree_0 declares 2"),
    "a-node-beside": ([[0], [1]], r"trees\.chain-1's nodes as 3, and graph draft_tree_0 declares 2"),
    "no-node": ([], r"trees\.chain-1's nodes as 1, and graph draft_tree_0 declares 2"),
}


@pytest.mark.parametrize("paths, says", TREE_EDITS.values(), ids=TREE_EDITS)
def test_tree_paths_that_disagree_with_its_graphs_are_one_line(drafted, paths, says):
    resign(drafted, lambda m: m["trees"]["chain-1"].update(paths=paths))
    line = one_line(CliRunner().invoke(main, ["inspect", str(drafted)]))
    assert re.search(says, line), line


# a field of the wrong type -> what BundleError says (naming the field), before the digest check
WRONG_TYPES = {
    "graph-a-string": (
        lambda m: m["graphs"].update(vq_decode="vq_decode.onnx"),
        r"graphs\.vq_decode must be an object",
    ),
    "constants-missing": (lambda m: m.pop("constants"), r"constants must be an object, got None"),
    "paths-not-lists": (
        lambda m: m["trees"]["mc_sim_7b_63"].update(paths=[0, 1]),
        r"trees\.mc_sim_7b_63\.paths must",
    ),
    "paths-a-string": (
        lambda m: m["trees"]["mc_sim_7b_63"].update(paths="0"),
        r"trees\.mc_sim_7b_63\.paths must",
    ),
    "tree-graph-a-list": (
        lambda m: m["trees"]["mc_sim_7b_63"].update(graph=[]),
        r"trees\.mc_sim_7b_63\.graph must",
    ),
    "batch-sizes-a-number": (
        lambda m: m["constants"].update(batch_sizes=1),
        r"constants\.batch_sizes must be a list",
    ),
    "batch-sizes-strings": (
        lambda m: m["constants"].update(batch_sizes=["1"]),
        r"constants\.batch_sizes must list",
    ),
    "batch-sizes-empty": (
        lambda m: m["constants"].update(batch_sizes=[]),
        r"constants\.batch_sizes must list",
    ),
}


@pytest.mark.parametrize("change, says", WRONG_TYPES.values(), ids=WRONG_TYPES)
def test_fields_of_the_wrong_type_are_named(bundle, change, says):
    edit(bundle, change)
    with pytest.raises(BundleError, match=rf"^{bundle.resolve()}: {says}"):
        Bundle.open(bundle)


def test_no_wrong_type_anywhere_is_more_than_a_bundle_error(bundle):
    """Every field (the first items of lists), replaced by a value of each JSON kind or removed:
    BundleError, never KeyError/TypeError/..."""
    base = json.loads((bundle / MANIFEST).read_text())

    def fields(obj: Any, at: tuple = ()) -> Iterator[tuple]:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj[:2]) if isinstance(obj, list) else ()
        for key, value in items:
            yield (*at, key)
            yield from fields(value, (*at, key))

    crashes = []
    for at in fields(base):
        for value in (None, "x", 1, True, [], {}, [1], "DELETE"):
            manifest = copy.deepcopy(base)
            parent = manifest
            for key in at[:-1]:
                parent = parent[key]
            if value == "DELETE" and isinstance(parent, dict):
                del parent[at[-1]]
            else:
                parent[at[-1]] = value
            (bundle / MANIFEST).write_text(json.dumps(manifest))
            try:
                Bundle.open(bundle)
            except BundleError:
                pass
            except Exception as exc:  # noqa: BLE001  (what the test looks for)
                crashes.append((at, value, repr(exc)))
    assert crashes == []


@pytest.mark.parametrize("graph", ["vq_decode", "target_prefill", "target_ar_step"])
def test_inspect_of_a_bundle_without_a_graph_is_one_line(bundle, graph):
    edit(bundle, lambda m: m["graphs"].pop(graph))
    assert f"the bundle lacks its {graph} graph" in one_line(
        CliRunner().invoke(main, ["inspect", str(bundle)])
    )


def test_inspect_of_a_bundle_without_its_vq_decode_file_is_one_line(bundle):
    (bundle / "vq_decode.onnx").unlink()
    assert "vq_decode.onnx is missing" in one_line(CliRunner().invoke(main, ["inspect", str(bundle)]))


# -- runs killed part-way (real processes) --------------------------------------------------------


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``lantern ARGS`` as a terminal starts it: SIGINT at its default action (Ctrl-C raises
    KeyboardInterrupt) even when the suite itself runs as a shell's background job, whose
    children inherit SIGINT ignored."""
    return subprocess.Popen(
        [str(LANTERN), *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def kill_when(proc: subprocess.Popen, folder: Path, pattern: str, timeout: float = 60) -> None:
    """SIGKILL ``proc`` once something matching ``pattern`` appears in ``folder``."""
    deadline = time.monotonic() + timeout
    while not (folder.is_dir() and any(folder.glob(pattern))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary folder appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_a_killed_export_leaves_the_old_bundle_and_the_next_run_succeeds(
    tiny_model_dir, tmp_path, tmp_path_factory
):
    out = tmp_path / "b"
    shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), out)  # an older export, replaced by --force
    old = (out / MANIFEST).read_text()
    args = ["export", "-q", "--model", str(tiny_model_dir), "--cache-windows", "1"]
    args += ["--out", str(out), "--force"]
    kill_when(start(*args), tmp_path, ".b.*.tmp")
    assert (out / MANIFEST).read_text() == old and Bundle.open(out)  # untouched
    assert len(list(tmp_path.glob(".b.*.tmp"))) == 1  # the killed run's, for the next run to remove
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "tiny"]  # no .b.*.tmp, no .b.old
    assert (out / MANIFEST).read_text() != old and Bundle.open(out).model_name == "tiny"


@pytest.mark.slow
def test_killed_and_concurrent_first_runs_export_once(tiny_model_dir, tmp_path):
    """A run killed while it exports into an empty cache, then two first runs at once: both
    succeed, one exports (the other waits and reuses it), and no temporary file is left."""
    env = {"LANTERN_CACHE": str(tmp_path / "cache")}
    bundles = tmp_path / "cache" / "bundles"

    def run(name: str) -> subprocess.Popen:
        args = ["generate", "-q", "-n", "1", "--model", str(tiny_model_dir), "--backend", "onnxruntime"]
        return start(*args, "-o", str(tmp_path / f"{name}.png"), env=env)

    kill_when(run("killed"), bundles, ".tiny-*.tmp")
    assert len(list(bundles.glob(".tiny-*.tmp"))) == 1
    runs = [run("first"), run("second")]
    logs = [proc.communicate(timeout=120)[1] for proc in runs]
    assert [proc.returncode for proc in runs] == [0, 0], logs
    assert sum(log.count("exporting tiny to") for log in logs) == 1, logs
    assert len([p for p in bundles.iterdir() if not p.name.startswith(".")]) == 1
    assert [p.name for p in bundles.iterdir() if p.name.endswith(".tmp")] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "first.png", "second.png", "tiny"]
