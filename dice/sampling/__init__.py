"""Block-diffusion decoding (DESIGN.md §5; SDAR's and LLaDA's `generate`), and the path from a task to a program.

| module | |
| --- | --- |
| `sampler` | `generate`: the absolute block grid, the KV cache, CUDA graphs, optional `torch.compile` (`Engine`) |
| `choice` | one denoising step's token choice (`Sampling`): tokens per step from the block size, static or dynamic low-confidence remasking |
| `completion` | task -> prompt ids -> batched generation -> `Completion` (tokens, step map, code): `sample.py`, `evaluate.py`, SFT's prompts and RL's rollouts; the weights generation reads (RL's bf16 copy, FSDP2's parameters gathered) |
"""
