"""Per-request sampling in ``lantern serve`` (issue 60 item 8): requests with different
temperatures, top-k, top-p and CFG scales decode in one running batch, each request's images
those the Python API makes for it alone; a setting the server cannot decode with is a 400
naming the field. In-process (Starlette's TestClient over the app and a real engine)."""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
testclient = pytest.importorskip("starlette.testclient")  # needs httpx

from lantern_rt.api import load  # noqa: E402
from lantern_rt.families.loading import open_model_dir  # noqa: E402
from lantern_rt.models.model_dir import DEMO_DIR  # noqa: E402
from lantern_rt.models.vq import VQConfig, VQModel  # noqa: E402
from lantern_rt.runtime.tree import load_tree  # noqa: E402
from lantern_rt.serve.app import ServeSettings, create_app  # noqa: E402
from lantern_rt.serve.engine import Engine  # noqa: E402
from lantern_rt.serve.metrics import Metrics  # noqa: E402
from tests.conftest import TINY_VQ, exported, tiny_gpt, write_model_dir  # noqa: E402

GEN = "/v1/images/generations"
TREE = "chain-3"
# eight requests, eight temperatures (0: greedy), with top-k, top-p and CFG scales mixed in;
# None: the server's (its flags: the demo's defaults here)
SETTINGS = [
    {"temperature": 0.0, "cfg_scale": 3.0},
    {"temperature": 0.5, "top_k": 20, "cfg_scale": 2.0},
    {"temperature": 0.7, "top_p": 0.8, "cfg_scale": 4.0},
    {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "cfg_scale": 1.5},
    {"temperature": 1.0},
    {"temperature": 1.2, "top_k": 100, "cfg_scale": 2.5},
    {"temperature": 1.5, "top_p": 0.95},
    {"temperature": 2.0, "top_k": 10, "cfg_scale": 1.0},
]


def client_of(engine: Engine) -> testclient.TestClient:
    return testclient.TestClient(create_app(engine, ServeSettings("model", 300.0)))


def pngs(response) -> np.ndarray:
    """The response's images as uint8 [n, H, W, C]."""
    arrays = []
    for item in response.json()["data"]:
        array = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
        arrays.append(array[..., None] if array.ndim == 2 else array)
    return np.stack(arrays)


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's chain-3 bundle for batch sizes 1 and 8 (exported once per run)."""
    out = tmp_path_factory.mktemp("serve-sampling") / "bundle"
    return exported(open_model_dir(DEMO_DIR), out, [load_tree(TREE)], windows=1, batch_sizes=(1, 8))


@pytest.mark.slow  # torch: 20 s; onnxruntime: the export of a batch-8 bundle (shared), then 15 s
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_eight_settings_in_one_batch_give_each_request_its_images_alone(backend: str, request) -> None:
    source = request.getfixturevalue("demo_bundle") if backend == "onnxruntime" else None
    # one thread for the server and the images made alone: no kernel splits its work
    options = {"backend": backend, "method": "lantern++", "tree": TREE, "threads": 1}
    engine = Engine(lambda: load(source, batch_size=8, **options), 16, Metrics())
    busy = []  # slots decoding after each step, seen from the loop's keep()
    keep = engine.keep
    engine.keep = lambda key, tokens: busy.append(len(engine._busy)) or keep(key, tokens)
    bodies = [{"prompt": str(i), "seed": 50 + i, **s} for i, s in enumerate(SETTINGS)]
    with client_of(engine) as client:
        assert engine.ready.wait(300), engine.failed
        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(lambda body: client.post(GEN, json=body), bodies))
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    assert max(busy) == 8  # the eight requests decoded in one batch
    made = [pngs(r)[0] for r in responses]
    for body, image in zip(bodies, made, strict=True):
        settings = {k: v for k, v in body.items() if k not in ("prompt", "seed")}
        alone = load(source, batch_size=1, **options, **settings)(int(body["prompt"]), seed=body["seed"])
        assert np.array_equal(alone.array[0], image), body
    assert len({image.tobytes() for image in made}) == 8


@pytest.mark.slow  # the export of the batch-8 bundle above (shared), then 5 s
def test_the_vq_decoder_gives_each_thread_its_own_images(demo_bundle) -> None:
    """A server's requests decode their images in threads of their own, at once, on the bundle's
    one VQ decoder: each gets the images of its own codes (its runner's buffers hold one call's;
    without a lock a request got another's image, about one `make test` in five)."""
    from lantern_rt.bundle import Bundle
    from lantern_rt.runtime.backends.bundle_graphs import BundleVQDecoder
    from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner

    bundle = Bundle.open(demo_bundle)
    decoder = BundleVQDecoder(bundle, ort_runner(threads=1))
    c = bundle.constants
    codes = torch.randint(
        0, c.vocab_size, (16, 1, c.grid_size**2), generator=torch.Generator().manual_seed(0)
    )
    want = [decoder.decode(row) for row in codes]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(decoder.decode, [row for _ in range(4) for row in codes]))
    assert all(torch.equal(g, want[i % len(codes)]) for i, g in enumerate(got))


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, testclient.TestClient]]:
    """Clients of AR servers on a tiny model with a vocabulary above the filter's sort width:
    ``guided`` (its CFG scale 2), ``unguided`` (CFG scale 1: one row per image) and ``filtered``
    (top-k 40 and top-p 0.9)."""
    folder = tmp_path_factory.mktemp("serve-sampling")
    vq = VQModel(VQConfig(**{**TINY_VQ, "codebook_size": 4096})).eval()
    model = write_model_dir(folder / "tiny", tiny_gpt(vocab_size=4096), vq)
    clients = {}
    servers = {"guided": {}, "unguided": {"cfg_scale": 1.0}, "filtered": {"top_k": 40, "top_p": 0.9}}
    for name, flags in servers.items():
        engine = Engine(lambda f=flags: load(model, backend="torch", method="ar", **f), 8, Metrics())
        clients[name] = client_of(engine).__enter__()
        assert engine.ready.wait(60), engine.failed
    yield clients
    for client in clients.values():
        client.__exit__(None, None, None)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("temperature", -0.5, "temperature must be >= 0"),
        ("temperature", math.inf, "temperature must be >= 0"),
        ("top_p", 0.0, "top-p must be in (0, 1]"),
        ("top_p", 1.5, "top-p must be in (0, 1]"),
        ("top_p", 0.9, "needs a top-k of at most 3840"),  # the vocabulary is not sorted whole
        ("top_k", -1, "top-k must be >= 0"),
        ("top_k", 5000, "top-k 5000 is above 3840"),
        ("cfg_scale", -1.0, "CFG scale must be a finite number >= 0"),
        ("cfg_scale", math.nan, "CFG scale must be a finite number >= 0"),
    ],
)
def test_a_bad_setting_is_a_400_naming_the_field(tiny_engines, field: str, value: float, words: str) -> None:
    response = tiny_engines["guided"].post(GEN, content=json.dumps({"prompt": "1", field: value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ") and words in error["message"]


def test_guidance_a_server_does_not_run_is_a_400_and_other_settings_decode(tiny_engines) -> None:
    """Settings other than the server's decode (no 'differs from the running decode' any more);
    a CFG scale above 1 on a server that runs one row per image is a 400 naming cfg_scale."""
    guided, unguided = tiny_engines["guided"], tiny_engines["unguided"]
    body = {"prompt": "1", "temperature": 0.3, "top_k": 7, "top_p": 0.5, "cfg_scale": 4.0}
    assert guided.post(GEN, json=body).status_code == 200
    assert unguided.post(GEN, json={**body, "cfg_scale": 0.5}).status_code == 200
    response = unguided.post(GEN, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cfg_scale", response.text
    assert "unconditional row" in response.json()["error"]["message"]


def test_settings_are_checked_together(tiny_engines) -> None:
    """A request may turn top-k off as it turns top-p off too (each alone would leave top-p
    without the top-k this vocabulary needs); top-k off alone is a 400 naming top_k."""
    filtered = tiny_engines["filtered"]
    assert filtered.post(GEN, json={"prompt": "1", "top_k": 0, "top_p": 1.0}).status_code == 200
    response = filtered.post(GEN, json={"prompt": "1", "top_k": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k", response.text
    assert "needs a top-k" in response.json()["error"]["message"]
