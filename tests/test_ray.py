"""Ray end to end, each on a real local Ray with CPU workers: ``lantern serve --ray`` as a Ray
Serve deployment of two replicas (ready, ``lantern generate``'s images over HTTP, SIGTERM: exit 0,
Ray shut down, no process left), and ``lantern generate-set --ray`` starting a Ray of its own for
the run (two actors, the shards of the run without Ray, Ray shut down, no process left).

One Ray runs at a time: the server's (its own process, a local Ray it starts and stops), then the
set's (in this process). A process counts as theirs when its environment holds this test's
marker, which every process Ray starts inherits from the command."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from lantern_rt.cli import main
from lantern_rt.images import grid
from lantern_rt.serve.ray_serve import ReplicaPlan, plan_replicas
from tests.conftest import free_port, tiny_gpt, tiny_vq, write_model_dir

pytest.importorskip("ray.serve")
pytest.importorskip("ray.data")
if not sys.platform.startswith("linux"):
    pytest.skip("finds Ray's processes in /proc", allow_module_level=True)

MARK = "LANTERN_RAY_TEST"
# the same images in every command: the torch backend on one thread (a replica's share of 2 CPUs)
SAME = ("--backend", "torch", "--threads", "1")


def marked(mark: str) -> list[int]:
    """The processes other than this one whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def wait_until_gone(mark: str, seconds: float = 30.0) -> list[int]:
    """The marked processes still there after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_marked(mark: str) -> None:
    """Kill what a failed test left (the processes this test's command started, by id)."""
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module", autouse=True)
def one_ray_at_a_time(ray_alone) -> None:
    """No other test worker's Ray runs beside this module's."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny", tiny_gpt(3), tiny_vq(3))


@dataclass
class RayServer:
    url: str
    process: subprocess.Popen
    log: Path
    mark: str

    def get(self, path: str) -> tuple[int, dict]:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return response.status, json.load(response)

    def generate(self, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + "/v1/images/generations",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            return json.load(response)


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    """``lantern serve --ray`` with two replicas, up once it says every replica is ready."""
    tmp = tmp_path_factory.mktemp("ray-serve")
    mark, port, log = uuid.uuid4().hex, free_port(), tmp / "log"
    env = {**os.environ, MARK: mark, "LANTERN_CACHE": str(tmp / "cache")}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own
    command = [
        sys.executable,
        "-m",
        "lantern_rt.cli",
        "serve",
        "--ray",
        "--replicas",
        "2",
        "--model",
        str(tiny_dir),
    ]
    command += SAME
    process = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    served = RayServer(f"http://127.0.0.1:{port}", process, log, mark)
    deadline = time.monotonic() + 240  # Ray, Serve and two replicas loading: 25-45 s on 2 cores
    try:
        while "every replica is ready" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"lantern serve --ray did not get ready ({process.poll()}): {log.read_text()}")
            time.sleep(0.5)
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        kill_marked(mark)


def pngs(response: dict) -> np.ndarray:
    """The response's images as uint8 [n, H, W, C]."""
    arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in response["data"]]
    return np.stack([a[..., None] if a.ndim == 2 else a for a in arrays])


def test_replicas_by_default_one_per_gpu_else_one_with_every_cpu() -> None:
    assert plan_replicas(None, True, {"CPU": 16, "GPU": 4}) == ReplicaPlan(4, 0, 1)
    assert plan_replicas(2, True, {"CPU": 16, "GPU": 4}) == ReplicaPlan(2, 0, 1)
    assert plan_replicas(None, False, {"CPU": 16, "GPU": 4}) == ReplicaPlan(1, 16, 0)
    assert plan_replicas(3, False, {"CPU": 16}) == ReplicaPlan(3, 5, 0)
    assert plan_replicas(4, False, {"CPU": 2}) == ReplicaPlan(4, 1, 0)


@pytest.mark.slow
def test_two_replicas_ready(server: RayServer) -> None:
    assert server.get("/health/ready") == (200, {"status": "ready"})
    assert server.get("/v1/models")[1]["data"][0]["id"] == "tiny"
    replicas = [pid for pid in marked(server.mark) if cmdline(pid).startswith("ray::ServeReplica:lantern")]
    assert len(replicas) == 2, [cmdline(pid) for pid in marked(server.mark)]


@pytest.mark.slow
def test_same_images_as_lantern_generate(server: RayServer, tiny_dir: Path, tmp_path: Path) -> None:
    """Four requests at once (both replicas take some): each has ``lantern generate``'s images."""
    out = tmp_path / "grid.png"
    args = ["generate", "--model", str(tiny_dir), *SAME, "--class", "3", "-n", "2", "--seed", "7"]
    r = CliRunner().invoke(main, [*args, "-q", "-o", str(out)])
    assert r.exit_code == 0, r.output
    expected = np.asarray(Image.open(out))
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(server.generate, [{"prompt": "3", "n": 2, "seed": 7}] * 4))
    for response in responses:
        images = pngs(response)
        made = grid(images, rows=1, scale=max(1, 64 // images.shape[1]))
        assert np.array_equal(made[..., 0] if expected.ndim == 2 else made, expected)
        assert response["lantern"]["seed"] == 7


@pytest.mark.slow
def test_sigterm_exits_0_and_stops_ray(server: RayServer) -> None:
    assert len(marked(server.mark)) > 2  # Ray's processes: GCS, raylet, controller, proxy, replicas
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=90) == 0, server.log.read_text()
    assert "Traceback" not in server.log.read_text()
    left = wait_until_gone(server.mark)
    assert not left, [cmdline(pid) for pid in left]


@pytest.mark.slow
def test_generate_set_on_a_ray_of_its_own_matches_the_local_run(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ray`` alone starts a local Ray for the run, even where RAY_ADDRESS names a cluster
    (here a bad one), and shuts it down; two actors make the local run's shards."""
    import ray

    assert not ray.is_initialized()
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    monkeypatch.setenv("RAY_ADDRESS", "no-such-cluster")  # joining it would fail at once
    args = ["generate-set", "-q", "--model", str(tiny_dir), *SAME, "--classes", "1,3", "-n", "3"]
    args += ["--unit-size", "2"]
    local = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "local")])
    assert local.exit_code == 0, local.output
    try:
        on_ray = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "ray"), "--ray", "--actors", "2"])
        assert on_ray.exit_code == 0, on_ray.output
        assert not ray.is_initialized()
        left = wait_until_gone(mark)
        assert not left, [cmdline(pid) for pid in left]
    finally:
        kill_marked(mark)
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert (summary["mode"], summary["workers"], summary["made_this_run"]) == ("ray", 2, 6)
    names = sorted(p.name for p in (tmp_path / "local").glob("shard-*.npz"))
    assert names == sorted(p.name for p in (tmp_path / "ray").glob("shard-*.npz")) and len(names) == 4
    for name in names:
        with np.load(tmp_path / "local" / name) as a, np.load(tmp_path / "ray" / name) as b:
            for key in ("codes", "labels", "index", "images"):
                assert np.array_equal(a[key], b[key]), (name, key)


def test_serve_with_a_bad_ray_address_is_one_line_and_exit_2(tiny_dir: Path) -> None:
    env = {**os.environ, "RAY_ADDRESS": "no-such-cluster"}
    command = [sys.executable, "-m", "lantern_rt.cli", "serve", "--ray", "--model", str(tiny_dir), *SAME]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()  # then Ray's reason, in its own words
    assert line.startswith("error: cannot join the Ray cluster RAY_ADDRESS=no-such-cluster: "), line
