"""Shared fixtures: tiny random models in LlamaGen's layout, written as model directories."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import socket
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lantern_rt.fileio import held
from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.config import GPTConfig, VQConfig, to_dict
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel

# Tiny models run fastest on one thread, and a second thread only fights any background job.
torch.set_num_threads(1)

TINY_GPT = dict(
    dim=32,
    n_layer=2,
    n_head=2,
    multiple_of=16,
    num_classes=5,
    vocab_size=64,
    block_size=16,
    token_dropout_p=0.0,
    resid_dropout_p=0.0,
    ffn_dropout_p=0.0,
)
TINY_VQ = dict(
    codebook_size=64,
    codebook_embed_dim=4,
    codebook_show_usage=False,
    encoder_ch_mult=[1, 1],
    decoder_ch_mult=[1, 1],
    z_channels=32,
    ch=32,
    num_res_blocks=1,
    in_channels=1,
    out_channels=1,
)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter non-trivial random values (LlamaGen zero-initialises the head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_gpt(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return randomize(Transformer(GPTConfig(**{**TINY_GPT, **overrides})), seed)


def tiny_vq(seed: int = 0) -> VQModel:
    torch.manual_seed(seed)
    return VQModel(VQConfig(**TINY_VQ)).eval()


def write_model_dir(root: Path, gpt: Transformer, vq: VQModel, gpt_file: str = "gpt.safetensors") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if gpt_file.endswith(".safetensors"):
        save_safetensors(gpt, root / gpt_file)
    else:
        torch.save({"model": gpt.state_dict()}, root / gpt_file)
    save_safetensors(vq, root / "vq.safetensors")
    config = {
        "format_version": 1,
        "name": "tiny",
        "gpt": to_dict(gpt.config),
        "vq": to_dict(vq.config),
        "files": {"gpt": gpt_file, "vq": "vq.safetensors"},
        "class_names": ["a", "b", "c", "d", "e"],
        "sampling_defaults": {"cfg_scale": 2.0},
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Every test starts on torch's one thread: a command run with ``--threads N`` (generate-set,
    bench, the API) leaves N for the rest of its process, here the test worker's."""
    yield
    torch.set_num_threads(1)


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny", tiny_gpt(), tiny_vq())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a server the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The longest modules (their exports, or Ray's start), in the order the test workers take them:
# `make test` hands whole modules to its workers in collection order (pytest-xdist's --dist
# loadfile --no-loadscope-reorder), so these start early and the workers end at about the same
# time; the others follow in file order. test_ray.py comes early and test_generate_set.py late:
# both hold ray_alone, so that a worker does not wait for the other's Ray.
LONGEST_FIRST = (
    "test_trt_rtx_demo.py",
    "test_chameleon_runtime.py",
    "test_batching.py",
    "test_cache_in_place.py",
    "test_jacobi.py",
    "test_openvino.py",
    "test_ray.py",
    "test_api.py",
    "test_guidance.py",
    "test_cache_windows.py",
    "test_ort_speculative.py",
    "test_faults_output.py",
    "test_text_to_image.py",
    "test_widen.py",
    "test_export_memory.py",
    "test_trt_rtx_families.py",
    "test_weight_only.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of LONGEST_FIRST first, the others after them in their order (and every
    module's tests in theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


# --- shared by the whole run ----------------------------------------------------------------------
# ONNX exports are most of the suite's time (3-6 s a graph even for the tiny models), so a bundle
# is exported once per run, whichever module or test worker asks for it first.

SHARED = "LANTERN_TEST_SHARED"  # the environment variable naming the run's shared folder


@pytest.fixture(scope="session", autouse=True)
def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The run's folder shared by its test workers (pytest-xdist's workers keep their base
    temporary folders in the run's), named by ``$LANTERN_TEST_SHARED``, and the export cache in
    it, ``$LANTERN_CACHE`` for every test that sets none of its own: a model directory a command
    runs on onnxruntime is exported once per run (the cache's lock makes concurrent first uses
    wait for one export), and nothing is written to the user's cache."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SHARED, str(root))
        mp.setenv("LANTERN_CACHE", str(root / "cache"))
        yield root


@pytest.fixture(scope="session", autouse=True)
def graph_store(shared_folder: Path) -> Iterator[None]:
    """Every graph the exporter writes in this process (``exporter.export_graph``) is exported
    once per run: bundles that differ in their trees, windows or batch sizes share their other
    graphs (prefill, AR step, VQ decoder), keyed by everything the graph module holds (weights,
    tree, shapes) and the export's opset. A test that patches any ``lantern_rt`` function (to
    make an export fail, say) exports for itself: the store is bypassed while any module
    attribute differs from the session's start."""
    from lantern_rt.export import exporter
    from lantern_rt.settings import DEFAULT_OPSET

    real = exporter.export_graph
    store = shared_folder / "graphs"
    store.mkdir(exist_ok=True)

    def export_graph(
        module, reference, folder: Path, opset: int = DEFAULT_OPSET, threads: int = 0
    ) -> dict[str, Any]:
        if _lantern_attributes(start) != start:
            return real(module, reference, folder, opset, threads)
        key = hashlib.sha256(
            repr((_fingerprint(module), _fingerprint(reference), opset)).encode()
        ).hexdigest()
        kept = store / key[:24]
        with held(store / f".{kept.name}.lock", create=True):
            if not kept.is_dir():
                entry = real(module, reference, folder, opset, threads)
                tmp = store / f".{kept.name}.tmp"
                tmp.mkdir()
                for name in (entry["file"], entry["file"] + ".data"):  # .data: its weights, if any
                    if (folder / name).exists():
                        shutil.copy2(folder / name, tmp / name)
                (tmp / "entry.json").write_text(json.dumps(entry))
                tmp.rename(kept)
                return entry
        entry = json.loads((kept / "entry.json").read_text())
        for name in (entry["file"], entry["file"] + ".data"):
            if (kept / name).exists():
                shutil.copy2(kept / name, folder / name)
        return entry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exporter, "export_graph", export_graph)
        start = _lantern_attributes()
        yield


def _lantern_attributes(like: dict[str, dict[str, int]] | None = None) -> dict[str, dict[str, int]]:
    """id of every attribute of every imported ``lantern_rt`` module (of those in ``like``)."""
    names = like.keys() if like is not None else [n for n in sys.modules if n.startswith("lantern_rt")]
    return {
        n: {
            k: id(v)
            for k, v in vars(sys.modules[n]).items()
            if not k.startswith("__") and (like is None or k in like[n])
        }
        for n in names
    }


_STATE_DICT_HOOKS = frozenset(
    (
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    )
)


def _fingerprint(obj: Any, seen: dict[int, Any] | None = None) -> Any:
    """A value equal for objects that export the same graph: tensors by content, modules and
    other objects by their type and attributes, recursively."""
    seen = {} if seen is None else seen
    if isinstance(obj, (str, int, float, bool, type(None))):
        return obj
    if isinstance(obj, torch.Tensor):
        data = obj.detach().contiguous().cpu()
        raw = data.view(torch.uint8) if data.dtype != torch.bool and data.numel() else data.to(torch.uint8)
        return ("tensor", str(obj.dtype), tuple(obj.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest())
    if id(obj) in seen:
        return ("seen", type(obj).__qualname__)
    seen[id(obj)] = obj  # held, so that no later temporary takes its id
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, *(_fingerprint(x, seen) for x in obj))
    if isinstance(obj, dict):
        return ("dict", *((repr(k), _fingerprint(v, seen)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", *sorted(repr(_fingerprint(x, seen)) for x in obj))
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        function = getattr(obj, "__func__", obj)
        closure = [c.cell_contents for c in function.__closure__ or ()]
        bound = getattr(obj, "__self__", None)
        return ("function", function.__module__, function.__qualname__, _fingerprint([closure, bound], seen))
    if isinstance(obj, (type, torch.dtype, torch.device, types.BuiltinFunctionType)):
        return repr(obj)
    if isinstance(obj, torch.nn.Module):
        # its state-dict hooks only (de)serialize it, and are keyed by a process-wide count
        kept = {k: v for k, v in vars(obj).items() if k not in _STATE_DICT_HOOKS}
        return (type(obj).__module__, type(obj).__qualname__, _fingerprint(kept, seen))
    if hasattr(obj, "__dict__"):
        return (type(obj).__module__, type(obj).__qualname__, _fingerprint(vars(obj), seen))
    if hasattr(obj, "__slots__"):
        return (type(obj).__qualname__, *(_fingerprint(getattr(obj, s, None), seen) for s in obj.__slots__))
    return repr(obj)


def shared_cache() -> Path:
    """The run's export cache (``$LANTERN_CACHE`` of the tests that set none of their own)."""
    return Path(os.environ[SHARED]) / "cache"


def exported(md: ModelDir, out: Path, trees: Sequence[Any] = (), **options: Any) -> Path:
    """``export_bundle(md, out, trees, **options)``: exported once per run for the same model files
    (config included), trees and options that shape the bundle, by whichever test asks first
    (under a lock, across test workers), and copied to ``out``, a folder of the caller's own."""
    from lantern_rt.export.exporter import export_bundle
    from lantern_rt.export_cache import model_fingerprint
    from lantern_rt.runtime.tree import tree_to_json

    call = inspect.signature(export_bundle).bind(md, out, trees, **options)
    call.apply_defaults()
    unshaping = ("model_dir", "out", "trees", "threads", "progress", "overwrite", "on_start", "models")
    settings = {k: v for k, v in call.arguments.items() if k not in unshaping}
    settings |= {"model": model_fingerprint(md), "trees": [tree_to_json(t) for t in trees]}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(os.environ[SHARED]) / "bundles"
    folder.mkdir(exist_ok=True)
    bundle = folder / f"{md.name}-{key}"
    with held(folder / f".{bundle.name}.lock", create=True):
        if not bundle.is_dir():
            export_bundle(md, bundle, trees, **{"threads": 1, **options})
    shutil.copytree(bundle, out)
    return Path(out)


# --- built once per session --------------------------------------------------------------------
# Tests only read these (a test that writes copies first); each checks at the end of the session
# that no test changed it.


def pattern_codes(n: int, vocab: int, length: int, classes: int, seed: int = 0):
    """Sequences x_{t+1} = x_t + (class + 1) mod V with a random start: easy to predict."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    codes = (start + (labels[:, None] + 1) * torch.arange(length)) % vocab
    return codes, labels


def _state(*modules: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]


def assert_unchanged(before: list[dict[str, torch.Tensor]], *modules: torch.nn.Module) -> None:
    for state, module in zip(before, modules, strict=True):
        now = _state(module)[0]
        changed = sorted(state.keys() ^ now.keys()) + [
            k for k in state.keys() & now.keys() if not torch.equal(state[k], now[k])
        ]
        assert not changed, f"a test changed the session's {type(module).__name__}: {changed}"
        assert not module.training, f"a test left the session's {type(module).__name__} in training mode"


def _digest(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def assert_folder_unchanged(before: dict[str, bytes], folder: Path) -> None:
    after = _digest(folder)
    changed = sorted(
        set(before) ^ set(after) | {k for k in before.keys() & after.keys() if before[k] != after[k]}
    )
    assert not changed, f"a test changed the session's folder {folder}: {changed}"


@pytest.fixture(scope="session")
def trained_pair():
    """A target trained on a learnable pattern and a drafter trained against it (test_speculative,
    test_batching, test_calibrate and test_ort_speculative)."""
    from lantern_rt.models.drafter import Drafter, DrafterConfig
    from lantern_rt.training.drafter import DrafterTraining, train_drafter

    torch.manual_seed(0)
    target = tiny_gpt(11)
    cfg = target.config
    codes, labels = pattern_codes(256, cfg.vocab_size, cfg.block_size, cfg.num_classes)
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    target.train()
    for step in range(150):
        sel = torch.arange(step * 32, step * 32 + 32) % len(codes)
        logits = target(codes[sel, :-1], labels[sel], train=True)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), codes[sel].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.eval()
    drafter = Drafter(DrafterConfig.for_target(cfg), cfg)
    train_drafter(
        target,
        drafter,
        codes.numpy(),
        labels.numpy(),
        DrafterTraining(steps=150, batch=32, lr=3e-3),
        progress=False,
    )
    before = _state(target, drafter)
    yield target, drafter
    assert_unchanged(before, target, drafter)


def verify_step(target, tokens: torch.Tensor, vocab: int, tree=None, commit: bool = True):
    """One greedy, exact verify call of ``tokens`` [N+1] over ``tree`` (default: the root-only
    tree, an AR step) after the committed cache, then (``commit``) the accepted path committed;
    the backend's :class:`~lantern_rt.runtime.acceptance.Verified`."""
    from lantern_rt.runtime.acceptance import Relaxation, relax_inputs
    from lantern_rt.runtime.backends.base import Draft
    from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs
    from lantern_rt.runtime.tree import ROOT_ONLY

    tree = tree or ROOT_ONLY
    device, n = target.cache.length.device, tree.num_nodes + 1
    filters = filter_inputs(SamplingConfig(cfg_scale=2.0, temperature=0.0), device)
    relax = relax_inputs(Relaxation("exact"), None, vocab, True, device)
    draft = Draft(
        tokens.to(device).reshape(1, n),
        torch.ones(1, n, dtype=torch.bool, device=device),
        torch.zeros(1, n, vocab, device=device),
    )
    out = target.verify(
        tree,
        draft,
        torch.zeros(1, n, device=device),
        torch.zeros(1, vocab, device=device),
        filters,
        relax,
    )
    if commit:
        target.cache.commit(out.new_k, out.new_v, out.kept, out.length + 1)
    return out


PROMPT_SLOTS = 12  # caption slots of the prompt models (a short prompt is padded, a long one cut)


@pytest.fixture(scope="session")
def prompt_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A t2i model directory whose config.json names a tiny T5 folder (files.t5)
    (test_text_to_image and test_jacobi)."""
    from tests.t5_fixtures import TINY_T5, tiny_t5

    root = tmp_path_factory.mktemp("prompts")
    model = tiny_gpt(8, model_type="t2i", cls_token_num=PROMPT_SLOTS, caption_dim=TINY_T5["d_model"])
    md = write_model_dir(root / "model", model, tiny_vq())
    tiny_t5(md / "t5")
    config = json.loads((md / "config.json").read_text())
    config["files"]["t5"] = "t5"
    config["class_names"] = []
    (md / "config.json").write_text(json.dumps(config))
    before = _digest(md)
    yield md
    assert_folder_unchanged(before, md)


def _chameleon_dir(tmp_path_factory: pytest.TempPathFactory, layout: str) -> Iterator[Path]:
    pytest.importorskip("transformers")
    from tests.chameleon_fixtures import LUMINA_VQ, hf_model
    from tests.chameleon_fixtures import write_model_dir as write_chameleon

    model = hf_model(vq_config=LUMINA_VQ) if layout == "lumina" else hf_model()
    root = write_chameleon(tmp_path_factory.mktemp(layout), model, layout=layout)
    before = _digest(root)
    yield root
    assert_folder_unchanged(before, root)


@pytest.fixture(scope="session")
def anole_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Anole-layout model directory without a drafter (tests/chameleon_fixtures.py)."""
    yield from _chameleon_dir(tmp_path_factory, "anole")


@pytest.fixture(scope="session")
def lumina_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Lumina-mGPT-layout model directory (rows ending in row-end tokens), no drafter."""
    yield from _chameleon_dir(tmp_path_factory, "lumina")


@pytest.fixture(scope="module")
def ray_alone() -> Iterator[None]:
    """Held while a module's tests run Ray: one local Ray at a time on this machine, across test
    workers (a second local Ray started beside the first makes Ray Serve's proxy actor die)."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "lantern-rt-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
