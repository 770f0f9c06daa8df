"""Block-diffusion decoding (DESIGN.md §5; SDAR's and LLaDA's `generate`).

| module | |
| --- | --- |
| `sampler` | `generate`: the absolute block grid, the KV cache, CUDA graphs, optional `torch.compile` (`Engine`) |
| `choice` | one denoising step's token choice (`Sampling`): tokens per step from the block size, static or dynamic low-confidence remasking |
"""
