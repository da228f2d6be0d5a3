"""How many compute kernels a torch call launches, counted on the CPU with ``torch.profiler``
(issue 47's measure of a decode step's dispatch cost; ``scripts/count_kernels.py`` prints it),
and how many generated kernels and loop nests a compiled call's inductor code runs
(``scripts/compile_kernels.py``)."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import torch

# aten ops that launch no compute kernel of their own: views, allocations, casts to the same
# dtype (``to`` calls ``_to_copy`` when it does cast) and eval-mode dropout.
NOT_KERNELS = frozenset(
    "aten::" + name
    for name in (
        "view _unsafe_view reshape _reshape_alias as_strided expand transpose t permute slice select"
        " unsqueeze squeeze split split_with_sizes chunk unbind narrow flatten unflatten movedim alias"
        " detach lift_fresh empty empty_strided empty_like resolve_conj resolve_neg to type_as"
        " contiguous result_type dropout"
    ).split()
)


def eager_kernels(call: Callable[[], Any]) -> collections.Counter[str]:
    """The kernels one ``call()`` runs, by aten op: an op is a kernel when it is not in
    :data:`NOT_KERNELS` and no kernel runs below it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    counts: collections.Counter[str] = collections.Counter()

    def below(event: Any) -> int:
        inner = sum(below(child) for child in event.cpu_children)
        if inner == 0 and event.name.startswith("aten::") and event.name not in NOT_KERNELS:
            counts[event.name] += 1
            return 1
        return inner

    for event in prof.events():
        if event.cpu_parent is None:
            below(event)
    return counts


def generated_calls(code: str) -> collections.Counter[str]:
    """The generated kernels that inductor's output ``code`` (one compiled graph's wrapper) calls,
    by name, each as often as it is called: C++ functions (``cpp_fused_*``, each one or more loop
    nests: ``torch._inductor.metrics.generated_kernel_count`` counts the nests' kernel objects)
    on a CPU, Triton kernels on a GPU. Library calls (matmuls, attention) are not among them."""
    defined = re.findall(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", code, re.MULTILINE)
    body = code[code.find("def call(") :]
    calls = {name: len(re.findall(rf"\b{name}(?:\.run)?\(", body)) for name in defined}
    return collections.Counter({name: count for name, count in calls.items() if count})


def generated_nests(code: str) -> int:
    """The loop nests one call of inductor's output ``code`` runs: each generated C++ function's
    nests times the calls to it, and one per Triton kernel call. Unlike
    ``torch._inductor.metrics.generated_kernel_count`` this does not count the kernel objects of
    a fusion inductor tried and dropped (on a CPU it builds each nest's kernel twice when an
    outer-loop fusion fails)."""
    nests = {
        name: _cpp_nests(body)
        for name, body in re.findall(
            r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp)\(.*?r'''(.*?)'''\)",
            code,
            re.MULTILINE | re.DOTALL,
        )
    }
    return sum(nests.get(name, 1) * count for name, count in generated_calls(code).items())


def _cpp_nests(source: str) -> int:
    """Loop nests of one generated C++ function: the blocks its body opens at its top level
    (inside an OpenMP parallel region, that region's top level), one per nest (a loop, or a
    scalar computation with none) as inductor writes them."""
    depth, region, pending, count = 0, None, False, 0
    for line in source.splitlines():
        text = line.strip()
        if text.startswith("#pragma omp parallel"):
            pending = True
        elif text == "{":
            depth += 1
            if pending:
                region, pending = depth, False
            elif depth == (2 if region is None else region + 1):
                count += 1
        else:
            depth += text.count("{") - text.count("}")
            if region is not None and depth < region:
                region = None
    return count
