"""BiC-RL: DICE's two-phase TraceRL (DESIGN.md §7; arXiv 2602.11715, Gen-Verse/dLLM-RL).

One step, in the order `train_rl` runs it:

| module | |
| --- | --- |
| `rollout` | prompts -> completions with their step maps (which denoising round wrote each token) |
| `rewards` | completions -> rewards: the verifier's verdicts (`rl_rewards`), or a function of your own |
| `groups` | a step's groups: each task's rollouts, their rewards and group advantages, DAPO's dynamic sampling |
| `trace` | TraceRL's trace rounds of a response and their weights |
| `packing` | a response's rounds beside one clean stream, token-sized micro-batches, their log-probabilities |
| `old_logprobs` | the rollout policy's log-probs of the update's loss tokens, computed while the reward finishes |
| `update_memory` | the update's micro-batch budget, planned from the GPU memory free when it starts |
| `train_rl` | `train_rl`: a step's groups, the PPO-clip + k3 update, the log, the checkpoint |
"""
