import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = torch.sigmoid(x)
        x = torch.abs(x)
        x = x * x
        x = torch.log_softmax(x, dim=-1)
        return x


batch_size = 8
channels = 128
dim = 8192


def get_inputs():
    return [torch.randn(batch_size, channels, dim)]


def get_init_inputs():
    return []
