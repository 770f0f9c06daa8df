"""Building candidates' `load_inline` extensions (DESIGN.md §8.5): the verifier's build path.

| module | |
| --- | --- |
| `cache` | `BuildCache`: load_inline through a cache keyed by the program; compiler messages a person can act on |
| `inline` | load_inline programs as text: torch's generated files, the device/host split, cache-key normalisation |
| `cxx` | a small C++ tokenizer and file-scope splitter, enough to cut load_inline sources |
| `fast` | the fast build: torch's flags, a precompiled header, two compiles, one link |
| `pool` | `BuildPool`: prebuilding candidates on the CPU, apart from the GPU workers |
| `dispatch.h`, `dispatch.cpp` | the fast build's generic binding: per-program entries, one Python dispatcher per torch build |
"""
