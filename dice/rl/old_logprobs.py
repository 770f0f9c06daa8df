"""The rollout policy's log-probs of the update's loss tokens, computed while the reward finishes
(DESIGN.md §7).

With more than one optimiser step per RL step the TraceRL ratio is taken against the log-probs of
the policy that generated the rollouts (`dice.rl.train_rl.policy_update`), so the update starts with
a no-grad pass over all its micro-batches: about a quarter of its time. Those log-probs depend only
on the responses and on the weights, both fixed once the last token is generated, while the reward's
tail (the builds and verdicts of the last rollouts) leaves the GPU all but idle. `RolloutLogprobs`
runs that pass there, over every response in micro-batches of its own, until the reward is in; the
update then takes a micro-batch's old log-probs from it where all its rounds were computed, and runs
its own pass for the others. A loss token's log-prob does not depend on the micro-batch that holds
it (samples never attend to each other), so both passes agree to rounding: to ~1e-6 in float32, and
under bf16 autocast to the last bits of the logits, against the ratio's clip of +-0.2.
"""
from __future__ import annotations

import torch

from .packing import (CompileClock, PackedBatch, flex_length, group_rounds, micro_batches, pack, pad_batch,
                      packed_logprobs, round_items, uses_flex)
from .update_memory import UpdateTokens


class RolloutLogprobs:
    """Old log-probs by (response k, round index), for one RL step. Called by
    `dice.rl.rollout.generate_and_score` once the last response is generated, with the step's
    completions (k counted from `offset`: a dynamic-sampling round's first) and `finished()`,
    true once the reward is in; `old(batch)` gives an update micro-batch's, or None. Not under
    torchrun: under FSDP every forward is a collective that all processes must run alike.
    `compile_s`: what its FlexAttention forwards spent compiling (`CompileClock`). Its micro-batches
    have the update's budget (`tokens`: the run's `UpdateTokens.for_forwards`, asked when the pass
    starts; None: one of its own that holds no optimiser state), so both meet one FlexAttention shape."""

    def __init__(self, model, cfg, rt, pad_id: int, tokens: UpdateTokens | None = None):
        self.model, self.cfg, self.rt, self.pad_id = model, cfg, rt, pad_id
        self.tokens = tokens or UpdateTokens(model, None, rt)
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.compile_s = 0.0

    def __call__(self, completions: list, finished, offset: int = 0) -> None:
        if self.rt.world > 1 or finished():
            return
        config, device = self.model.config, next(self.model.parameters()).device
        use_flex = uses_flex(self.cfg, device)
        items = round_items(completions, [k for k, c in enumerate(completions) if c is not None and c.tokens],
                            config.block_size, offset)
        budget = self.tokens.for_forwards(self.cfg, completions)
        groups = group_rounds(items, [0.0] * len(items), self.cfg.update_rows, config.block_size, budget)
        clock = CompileClock.for_masks(use_flex, device)
        zero = dict.fromkeys((k for k, _, _ in items), 0.0)
        for chunk in micro_batches(groups, budget):
            if finished():
                break
            batch = pack([chunk] if use_flex else [[g] for g in chunk], config.mask_token_id, self.pad_id, zero)
            if use_flex:
                batch = pad_batch(batch, flex_length(batch.ids.shape[1], budget))
            with torch.no_grad(), self.rt.autocast(self.cfg.dtype):
                logp = clock.run("forward", batch, lambda: packed_logprobs(self.model, batch, use_flex))
            for (k, r, _), values in zip(batch.rounds, logp.split([n for _, _, n in batch.rounds])):
                self.values[(k, r)] = values
        self.compile_s += clock.seconds()

    def old(self, batch: PackedBatch) -> torch.Tensor | None:
        """`batch`'s old log-probs in its loss order, or None if a round of it was not computed."""
        if not batch.rounds or any((k, r) not in self.values for k, r, _ in batch.rounds):
            return None
        return torch.cat([self.values[(k, r)] for k, r, _ in batch.rounds])
