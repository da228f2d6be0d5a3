"""``lantern serve`` end to end: real server processes on 127.0.0.1 with the built-in demo,
talked to over HTTP as a client would (httpx, the openai package), checked against ``lantern
generate`` and against the server's own metrics.

The servers run on the run's export cache (tests/conftest.py), where the demo is exported once
for batch size 2 with the tree chain-2 and one cache window, for tests/test_api.py too: a fast server (lantern++) for equality,
concurrency, bad requests, metrics and the openai client, and a slow one (AR, a small queue and
a short deadline) for what needs time to pass: joining a running batch, 429, 504, a client
leaving, SIGTERM.
"""

from __future__ import annotations

import base64
import io
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from PIL import Image  # noqa: E402

from lantern_rt.images import grid  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.test_api import TREE  # noqa: E402

pytestmark = pytest.mark.slow
GEN = "/v1/images/generations"
MODEL = "fashion-mnist-demo"
DEADLINE = 1.0  # the strict server's --request-timeout


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def post(self, body, timeout: float = 120.0, **kwargs) -> httpx.Response:
        return httpx.post(self.url + GEN, json=body, timeout=timeout, **kwargs)

    def metric(self, name: str, labels: dict | None = None) -> float:
        """A sample's value in ``GET /metrics`` (parsed by prometheus_client's parser)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for family in parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and (labels is None or sample.labels == labels):
                    return sample.value
        return 0.0


SHAPE = ("--batch-size", "2", "--cache-windows", "1")


def start_server(log: Path, *options: str) -> Server:
    port = free_port()
    # the bundle of tests/test_api.py's generator (one cache window), exported once a run
    command = [sys.executable, "-m", "lantern_rt.cli", "serve", "--port", str(port), *SHAPE]
    process = subprocess.Popen([*command, *options], stdout=log.open("w"), stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 600  # the first start exports the demo
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"lantern serve exited with {process.returncode}: {log.read_text()}")
        try:
            if httpx.get(server.url + "/health/ready", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"lantern serve was not ready in 600 s: {log.read_text()}")


def stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("fast") / "log", "--tree", TREE, "--max-queue-images", "32")
    yield server
    stop(server)


# AR on eager torch with one thread: a round of the two slots takes about 0.8 s on the 2-core
# development machine (about 0.26 s on onnxruntime), so requests are long enough to watch
SLOW = ("--method", "ar", "--backend", "torch", "--threads", "1", "--max-queue-images", "8")


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("slow") / "log"
    server = start_server(log, *SLOW)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The slow server with a request deadline: eight images outlast it several times over."""
    log = tmp_path_factory.mktemp("strict") / "log"
    server = start_server(log, *SLOW, "--request-timeout", str(DEADLINE))
    yield server
    stop(server)


def pngs(response: httpx.Response) -> np.ndarray:
    """The response's images as uint8 [n, H, W, C]."""
    arrays = []
    for item in response.json()["data"]:
        array = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
        arrays.append(array[..., None] if array.ndim == 2 else array)
    return np.stack(arrays)


def test_same_images_as_lantern_generate(fast: Server, tmp_path: Path) -> None:
    response = fast.post({"prompt": "3", "n": 2, "seed": 7})
    assert response.status_code == 200, response.text
    images = pngs(response)
    out = tmp_path / "grid.png"
    subprocess.run(
        [sys.executable, "-m", "lantern_rt.cli", "generate", "--class", "3", "-n", "2", "--seed", "7"]
        + [*SHAPE, "--tree", TREE, "-q", "-o", str(out)],
        check=True,
        capture_output=True,
    )
    expected = np.asarray(Image.open(out))
    size = images.shape[1]
    made = grid(images, rows=1, scale=max(1, 64 // size))
    assert np.array_equal(made[..., 0] if expected.ndim == 2 else made, expected)
    lantern = response.json()["lantern"]
    assert lantern["method"] == "lantern++" and lantern["seed"] == 7
    assert [image["target_calls"] > 1 for image in lantern["images"]] == [True, True]
    assert uuid.UUID(response.headers["X-Request-Id"]).version == 4


def test_concurrent_requests_share_the_batch(fast: Server) -> None:
    bodies = [{"prompt": str(i % 10), "seed": i} for i in range(8)]
    t0 = time.perf_counter()
    one_by_one = [fast.post(b) for b in bodies]
    sequential = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(fast.post, bodies))
    concurrent = time.perf_counter() - t0
    assert [r.status_code for r in one_by_one + together] == [200] * 16
    for a, b in zip(one_by_one, together, strict=True):  # the seed decides, not the company
        assert a.json()["data"] == b.json()["data"]
    assert concurrent < sequential, (concurrent, sequential)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"n": 1}, 422),  # no prompt
        ({"prompt": "1", "n": 0}, 422),
        ({"prompt": "1", "n": 11}, 422),
        ({"prompt": "1", "size": "1024x1024"}, 400),
        ({"prompt": "no-such-class"}, 400),
        ({"prompt": "1", "response_format": "url"}, 400),
        ({"prompt": "1", "cfg_scale": -1.0}, 400),
        ({"prompt": ""}, 400),
        ('{"prompt": "1",', 400),  # broken JSON
        ({"prompt": "1", "pad": "x" * 200_000}, 413),
    ],
)
def test_bad_requests_get_json_errors(fast: Server, body, status: int) -> None:
    if isinstance(body, str):
        response = httpx.post(fast.url + GEN, content=body, headers={"content-type": "application/json"})
    else:
        response = fast.post(body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and "Traceback" not in response.text
    assert uuid.UUID(response.headers["X-Request-Id"]).version == 4


def test_each_request_samples_as_it_asks(fast: Server) -> None:
    """Settings other than the server's flags' decode (tests/test_serve_sampling.py checks their
    images); a bad one is a 400 naming the field."""
    assert fast.post({"prompt": "1", "cfg_scale": 3.0, "top_p": 1.0}).status_code == 200
    assert fast.post({"prompt": "1", "temperature": 0.5, "top_k": 9}).status_code == 200
    response = fast.post({"prompt": "1", "temperature": -0.5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"


def test_models_health_and_metrics(fast: Server) -> None:
    assert httpx.get(fast.url + "/health").json() == {"status": "ok"}
    models = httpx.get(fast.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    before = fast.metric("lantern:images_total")
    calls = fast.metric("lantern:target_calls_total")
    assert fast.post({"prompt": "Trouser", "n": 2}).status_code == 200
    assert fast.metric("lantern:images_total") == before + 2
    assert fast.metric("lantern:target_calls_total") > calls + 2
    assert fast.metric("lantern:requests_total", {"status": "200"}) >= 1
    assert fast.metric("lantern:requests_total", {"status": "422"}) >= 1
    assert fast.metric("lantern:num_slots") == 2
    assert fast.metric("lantern:num_slots_busy") == 0
    assert fast.metric("lantern:e2e_request_latency_seconds_count") >= 1


def test_openai_client(fast: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fast.url + "/v1", api_key="unused")
    result = client.images.generate(
        model=MODEL, prompt="7", n=2, response_format="b64_json", extra_body={"seed": 3}
    )
    assert len(result.data) == 2
    again = fast.post({"prompt": "7", "n": 2, "seed": 3})
    assert [d.b64_json for d in result.data] == [d["b64_json"] for d in again.json()["data"]]


def test_a_request_joins_the_running_batch(slow: Server) -> None:
    """Request A (one image) holds one of the two slots; B, sent while A decodes, takes the other
    at once instead of waiting for A's batch to drain."""
    a_end: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(slow.post, {"prompt": "1", "seed": 1})
        first.add_done_callback(lambda _: a_end.append(time.monotonic()))
        while slow.metric("lantern:num_slots_busy") < 1:
            time.sleep(0.02)
        time.sleep(0.1)
        sent = time.monotonic()
        second = slow.post({"prompt": "2", "seed": 2})
        first.result()
    assert second.status_code == 200, second.text
    a_left = a_end[0] - sent
    assert a_left > 0.2  # A was still decoding when B came
    waited = second.json()["lantern"]["queue_seconds"]
    assert waited < 0.5 * a_left, (waited, a_left)


def test_a_full_queue_is_429(slow: Server) -> None:
    client = httpx.Client(timeout=30)
    stop_first = threading.Event()

    def long_request() -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as c:
                c.post(slow.url + GEN, json={"prompt": "1", "n": 8})
        except httpx.TimeoutException:
            stop_first.set()  # the client leaves: its images are cancelled

    thread = threading.Thread(target=long_request)
    thread.start()
    while slow.metric("lantern:num_slots_busy") < 1:
        time.sleep(0.02)
    response = client.post(slow.url + GEN, json={"prompt": "1", "n": 4})
    thread.join()
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    assert "queue" in response.json()["error"]["message"]
    wait_idle(slow)


def wait_idle(server: Server, seconds: float = 10.0) -> float:
    """Seconds until no image waits or decodes; fails after ``seconds``."""
    t0 = time.monotonic()
    while server.metric("lantern:num_slots_busy") or server.metric("lantern:num_images_waiting"):
        if time.monotonic() - t0 > seconds:
            pytest.fail(f"the server still decodes {seconds} s later")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_passed_deadline_is_504_and_cancels(strict: Server) -> None:
    cancelled = strict.metric("lantern:images_cancelled_total")
    finished = strict.metric("lantern:images_total")
    t0 = time.monotonic()
    response = strict.post({"prompt": "4", "n": 8})  # 4 rounds of the two slots: longer than the deadline
    assert response.status_code == 504, response.text
    assert DEADLINE <= time.monotonic() - t0 < DEADLINE + 2
    assert "--request-timeout" in response.json()["error"]["message"]
    assert wait_idle(strict, 2.0) < 1.0  # the slots free at the next step, not after the images
    done = strict.metric("lantern:images_total") - finished
    assert strict.metric("lantern:images_cancelled_total") - cancelled == 8 - done
    assert done < 8


def test_a_client_that_leaves_frees_its_slots(slow: Server) -> None:
    cancelled = slow.metric("lantern:images_cancelled_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(slow.url + GEN, json={"prompt": "5", "n": 8}, timeout=httpx.Timeout(30, read=0.6))
    left = time.monotonic()
    wait_idle(slow, 3.0)
    assert time.monotonic() - left < 1.5  # eight AR images at two a time take several seconds
    assert slow.metric("lantern:images_cancelled_total") - cancelled >= 6


def test_sigterm_drains_then_exits_0(slow: Server) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(slow.post, {"prompt": "6", "n": 2, "seed": 4})
        while slow.metric("lantern:num_slots_busy") < 1:
            time.sleep(0.02)
        slow.process.send_signal(signal.SIGTERM)
        response = running.result()
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2
    assert slow.process.wait(timeout=30) == 0, slow.log.read_text()


@pytest.mark.parametrize(
    "options, message",
    [
        (["--top-p", "7"], "error: top-p must be in (0, 1], got 7.0"),
        (["--model", "no/such/dir"], "error: model directory not found: no/such/dir"),
    ],
)
def test_bad_server_settings_are_one_line_and_exit_2(options: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lantern_rt.cli", "serve", *options], capture_output=True, text=True
    )
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [message])


def test_ray_without_ray_serve_is_one_line_and_exit_2() -> None:
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("ray[serve] is installed: --ray would start a deployment")
    done = subprocess.run(
        [sys.executable, "-m", "lantern_rt.cli", "serve", "--ray"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --ray needs Ray Serve: pip install 'ray[serve]' (or drop --ray)"
    ]
