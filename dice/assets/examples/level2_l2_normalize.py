import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = torch.nn.functional.normalize(x, dim=-1)
        return x


batch_size = 4
channels = 512
dim = 1024


def get_inputs():
    return [torch.randn(batch_size, channels, dim)]


def get_init_inputs():
    return []
