"""The optional batch-1 fast path: each denoising step of one sequence as one persistent CUDA kernel
(bf16, Hopper, CuPy). Design and measurements: `dice/fused/NOTES.md`.

`dice.sampling.sampler.generate(..., engine=Engine(fused=True))` takes its steps from `FusedForward`, the
only place the sampler touches this package; `FusedDecoder` (`decoder.py`, `fused_decode.cu`) is the kernel.
"""
from __future__ import annotations

from ..sampling.sampler import CachedForward, Sampling
from .decoder import FusedDecoder, FusedDecodingError

__all__ = ["FusedDecoder", "FusedDecodingError", "FusedForward"]


class FusedForward(CachedForward):
    """`CachedForward` whose step is the fused kernel (attention over the whole cache, so one CUDA
    graph per step shape). With `greedy` (temperature 0) the kernel also makes the greedy choice
    (`dice.sampling.sampler.greedy_choice` on its logits), which the sampler then takes instead of its own."""

    def __init__(self, model, cache, use_graphs: bool, compile: bool = False, *, greedy: bool = False):
        super().__init__(model, cache, use_graphs, compile)
        self.run_layer, self.full_cache = None, True
        self.decoder = FusedDecoder(model, cache, greedy=greedy)

    def step_logits(self, *args):
        return self.decoder.step_logits(*args)

    def choose(self, logits, uniforms, s: Sampling):
        if self.decoder.greedy:
            return self.decoder.greedy_choice(logits.shape[1])
        return super().choose(logits, uniforms, s)
