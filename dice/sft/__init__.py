"""Supervised fine-tuning of a block-diffusion model (DESIGN.md §4; SDAR's and DICE's SFT recipes).

| module | |
| --- | --- |
| `data` | SFT records -> ChatML text -> token examples -> packed rows |
| `diffusion` | the noise schedule and the doubled `[x_t ; x_0]` forward's loss |
| `train_sft` | `train_sft`: the loop behind `python train.py --phase sft` |
"""
