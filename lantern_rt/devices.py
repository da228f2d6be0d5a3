"""The devices ``lantern info`` plans a bundle's memory for: what each maker documents, and what
this table keeps back from it.

``memory`` is the capacity the maker's data sheet or product page gives (``source``). Makers do
not document how much of it a program may use, so ``usable`` is that capacity less ``reserved``,
this table's allowance, and ``reserved_for`` says what it covers: on a Jetson the memory is
one LPDDR5 pool shared by the firmware's carve-outs, the operating system, the Python process
(torch and the CUDA context) and the GPU; on a discrete GPU the driver keeps part of the board
(``nvidia-smi`` reports less than the nominal size) and each process's CUDA context takes some.
"""

from __future__ import annotations

from dataclasses import dataclass

from lantern_rt.errors import UserError

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Device:
    """One device: ``key`` (``--device``), its name, compute capability, documented memory and
    the part of it this table counts as usable."""

    key: str
    name: str
    compute_capability: str
    memory: int  # bytes, as the maker documents it
    source: str  # where ``memory`` comes from
    reserved: int  # bytes this table keeps back
    reserved_for: str
    unified: bool  # one memory for the CPU and the GPU (a Jetson)
    tensorrt: str  # which TensorRT builds plans for it

    @property
    def usable(self) -> int:
        """Bytes a bundle may take: ``memory`` less ``reserved``."""
        return self.memory - self.reserved


JETSON_TENSORRT = (
    "TensorRT 10.3 (JetPack 6) or 11.4.1+ (JetPack 7.2.2+), built on the device (docs/jetson.md)"
)
DEVICES: tuple[Device, ...] = (
    Device(
        key="orin-nano-8gb",
        name="Jetson Orin Nano 8 GB",
        compute_capability="8.7",
        memory=8 * GIB,
        source="NVIDIA Jetson Orin Nano Series data sheet: 8GB 128-bit LPDDR5, shared by CPU and GPU",
        reserved=2 * GIB,
        reserved_for="firmware carve-outs (users report Linux seeing 7.2-7.4 GiB), a headless Ubuntu, the Python "
        "process with torch and the CUDA context",
        unified=True,
        tensorrt=JETSON_TENSORRT,
    ),
    Device(
        key="orin-nx-16gb",
        name="Jetson Orin NX 16 GB",
        compute_capability="8.7",
        memory=16 * GIB,
        source="NVIDIA Jetson Orin NX Series data sheet: 16GB 128-bit LPDDR5, shared by CPU and GPU",
        reserved=2560 * MIB,
        reserved_for="firmware carve-outs, a headless Ubuntu, the Python process with torch and the CUDA context",
        unified=True,
        tensorrt=JETSON_TENSORRT,
    ),
    Device(
        key="agx-orin-64gb",
        name="Jetson AGX Orin 64 GB",
        compute_capability="8.7",
        memory=64 * GIB,
        source="NVIDIA Jetson AGX Orin Series data sheet: 64GB 256-bit LPDDR5, shared by CPU and GPU",
        reserved=4 * GIB,
        reserved_for="firmware carve-outs, Ubuntu with its desktop, the Python process with torch and "
        "the CUDA context",
        unified=True,
        tensorrt=JETSON_TENSORRT,
    ),
    Device(
        key="rtx-4090",
        name="GeForce RTX 4090 24 GB",
        compute_capability="8.9",
        memory=24 * GIB,
        source="NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X (nvidia-smi reports 24564 MiB)",
        reserved=1 * GIB,
        reserved_for="what the driver keeps (12 MiB), the CUDA context and library workspaces, a "
        "desktop if the card drives one",
        unified=False,
        tensorrt="TensorRT 10.x/11.x, or TensorRT for RTX (compute capability 8.9: `lantern build-engines "
        "--flavour trt-rtx`, ahead of time)",
    ),
    Device(
        key="h100-80gb",
        name="H100 80 GB (SXM5, HBM3)",
        compute_capability="9.0",
        memory=81559 * MIB,
        source="NVIDIA H100 Tensor Core GPU data sheet: 80GB HBM3; nvidia-smi reports 81559 MiB",
        reserved=1 * GIB,
        reserved_for="the CUDA context and library workspaces",
        unified=False,
        tensorrt="TensorRT 10.x/11.x (TensorRT for RTX does not build for 9.0)",
    ),
)


def device_named(key: str) -> Device:
    """The device called ``key``; :class:`UserError` listing the known ones."""
    for device in DEVICES:
        if device.key == key:
            return device
    raise UserError(f"unknown device {key!r}: choose from {', '.join(d.key for d in DEVICES)}")


def device_table() -> list[str]:
    """docs/jetson.md's device table, a Markdown row per device."""
    lines = [
        "| `--device` | device | compute capability | memory, GiB | source | kept back, GiB | for | usable, GiB |",
        "|---|---|---|---:|---|---:|---|---:|",
    ]
    for d in DEVICES:
        lines.append(
            f"| {d.key} | {d.name} | {d.compute_capability} | {d.memory / GIB:.2f} | {d.source} | "
            f"{d.reserved / GIB:.1f} | {d.reserved_for} | {d.usable / GIB:.2f} |"
        )
    return lines
