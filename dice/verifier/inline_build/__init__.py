"""Building candidates' `load_inline` extensions (DESIGN.md §8.5): the verifier's build path.

| module | |
| --- | --- |
| `cache` | `BuildCache`: load_inline through a cache keyed by the program; compiler messages a person can act on |
| `inline` | load_inline programs as text: the device/host split, cache-key normalisation |
| `torch_inline` | torch's own load_inline as text: the two files it writes, the calls a program makes |
| `cxx` | a small C++ tokenizer and file-scope splitter, enough to cut load_inline sources |
| `toolchain` | torch's flags for a call, the compilers under shared slots, what is built once per toolchain (precompiled headers, the dispatcher, torch's names) |
| `fast` | the fast build: two compiles on a precompiled header, one link, the failures that are torch's own |
| `pool` | `BuildPool`: prebuilding candidates on the CPU, apart from the GPU workers |
| `pinned` | a candidate's own build folder, used only as its builds made it (digests, sealed in-memory copies) |
| `dispatch.h`, `dispatch.cpp` | the fast build's generic binding: per-program entries, one Python dispatcher per torch build |
"""
