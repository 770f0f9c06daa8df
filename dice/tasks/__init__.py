"""Kernel tasks and the prompts that ask for them (DESIGN.md §6).

| module | |
| --- | --- |
| `load` | KernelBench folders and DICE's JSON files -> `Task`s; the RL curriculum's order |
| `prompts` | the one DICE prompt builder (ChatML, or DICE's RL chat shape; user templates), code extraction |
| `synthetic_ops` | the ops of `dice.taskgen`'s curriculum: PyTorch line, CUDA line, constants |
| `copying` | whether a program copied its task's reference solution: structure, constants (issue #65) |

The synthetic curriculum that makes such files is `dice.taskgen` (a command: `python -m dice.taskgen`).
"""
