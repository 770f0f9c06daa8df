"""torch's own load_inline as text (DESIGN.md §8.5): the two files it writes, the calls a program makes.

`torch.utils.cpp_extension.load_inline` writes two files (torch 2.x, `load_inline`): main.cpp =
`#include <torch/extension.h>`, the cpp_sources and a PYBIND11_MODULE binding `functions`, built
by g++; cuda.cu = `#include <torch/types.h>`, `<cuda.h>`, `<cuda_runtime.h>` and the
cuda_sources, built by nvcc. `main_cpp` and `cuda_cu` write them exactly as torch does (the split
build starts from them: `inline.split_program`); `recorded_calls` reads the calls a trusted program
makes.
"""

from __future__ import annotations

TORCH_PREFIX = ("#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>")


def main_cpp(cpp_sources: list[str], functions, with_pytorch_error_handling: bool = True) -> str:
    """main.cpp exactly as torch.utils.cpp_extension.load_inline writes it (bindings included)."""
    sources = ["#include <torch/extension.h>", *cpp_sources]
    if functions is not None:
        if isinstance(functions, str):
            functions = [functions]
        if isinstance(functions, list):
            functions = {f: f for f in functions}
        elif not isinstance(functions, dict):
            raise ValueError(f"Expected 'functions' to be a list or dict, but was {type(functions)}")
        sources.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
        for name, doc in functions.items():
            bound = f"torch::wrap_pybind_function({name})" if with_pytorch_error_handling else name
            sources.append(f'm.def("{name}", {bound}, "{doc}");')
        sources.append("}")
    return "\n".join(sources)


def cuda_cu(cuda_sources: list[str]) -> str:
    """cuda.cu exactly as load_inline writes it."""
    return "\n".join([*TORCH_PREFIX, *cuda_sources])


def recorded_calls(program: str) -> list[dict]:
    """The keyword arguments of the load_inline calls a program makes at import, up to the first:
    runs the program's module-level code until then, so only for trusted programs (references)."""
    import torch.utils.cpp_extension as cpp_extension   # lazy: the one torch use of this otherwise text-only module
    calls = []

    def record(*args, **kwargs):
        calls.append({**dict(zip(("name", "cpp_sources", "cuda_sources", "functions"), args)), **kwargs})
        raise StopIteration

    original, cpp_extension.load_inline = cpp_extension.load_inline, record
    try:
        exec(compile(program, "<program>", "exec"), {"__name__": "dice_program"})
    except StopIteration:
        pass
    finally:
        cpp_extension.load_inline = original
    return calls
