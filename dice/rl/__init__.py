"""BiC-RL: DICE's two-phase TraceRL (DESIGN.md §7; arXiv 2602.11715, Gen-Verse/dLLM-RL).

One step (`train_rl.rl_step`) runs through its modules, each read top to bottom: `rollout` (scored
by `reward`), then `update`, called from `train_rl`. What they call lives outside dice/rl/: the
prompts, the sampler and the weights it reads (`dice.sampling.completion`), the update's packed micro-batches
(`dice.model.packing`), the sizes planned from the free GPU memory (`dice.memory`: the rollout batch,
the update's `UpdateTokens`) and the kernel verifier (`dice.verifier`).

| module | |
| --- | --- |
| `train_rl` | `rl_step`, the step `train.py` runs and `python -m dice.bench rl` times; `train_rl`, the loop: the run folder, the log, the checkpoint, the evaluation |
| `rollout` | the rollout side: a step's tasks and groups (DAPO's dynamic sampling), generation with the reward scoring beside it, the advantages |
| `reward` | the rewards: `Reward` (score a batch, `prepare` a step's tasks, `gpu_bytes`), a Python reward, the verifier's under strict or DICE's rules, a run's reward and its evaluation's |
| `update` | the update side: TraceRL's trace rounds, the plan of optimiser steps, the old log-probs beside the reward's tail, the PPO-clip + k3 loss |
"""
