'''The one prompt format of SFT, RL, sampling and evaluation, and reading code out of answers.

DESIGN.md §4 and §6. The model's input for a KernelBench-style task is always (`PromptFormat.text`)

    chat_prompt(kernel_prompt(task_src), chat)                         # end to end
    chat_prompt(kernel_prompt(task_src, prefix=p, suffix=s), chat)     # infilling (RL phase 1)

and a training target is chat_response(answer), or chat_response(answer, think=True) for a model
whose chat template writes a think block (`thinks`: SDAR/DICE). `PromptFormat` says which: the
chat turn (`CHAT_FORMATS`: ChatML, or DICE's RL rollout shape) and the one-shot example around our
kernel prompt, or a user's whole prompt text (`--prompt-template FILE`, `fill_template`) with
DICE's placeholders, so DICE's own wording can be used without being shipped here.
kernel_prompt carries the content of KernelBench's prompt (instruction, a one-shot elementwise-add
example, the task's `Model`, the request for `ModelNew`) in our own words, except for its first
sentence and the closing request, which keep KernelBench's wording (DICE's prompts are
KernelBench's). extract_code takes the program out of an answer (after its think block, if it
starts with one); keeps_skeleton tells whether an infilling answer kept the given prefix and suffix.
'''
from __future__ import annotations

import re
from dataclasses import dataclass

from ..model.tokenizer import IM_END, IM_START

INSTRUCTION = (
    "You write custom CUDA kernels to replace the pytorch operators in the given architecture "
    "to get speedups.\n\n"
    "You are free to choose which operators to replace: you may replace some of them with "
    "custom CUDA kernels and leave the others unchanged, replace several operators with custom "
    "implementations, fuse operators into a single kernel (for example matmul+relu), or change "
    "the algorithm (for example an online softmax). You are only limited by your imagination.\n"
)

REQUEST = (
    "Optimize the architecture named Model with custom CUDA operators! Name your optimized "
    "output architecture ModelNew. Output the new code in codeblocks. Please generate real code, "
    "NOT pseudocode, make sure the code compiles and is fully functional. Just output the new "
    "model code, no other text, and NO testing code!"
)

INFILL_REQUEST = (
    "Output the complete program: the skeleton's code before the gap, your code in place of "
    "the gap, and the skeleton's code after the gap, unchanged."
)

# Stands, on a line of its own, where an infilling answer must write the missing code.
INFILL_GAP = "# >>> write the CUDA source here <<<"

EXAMPLE_MODEL = '''\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        return a + b


def get_inputs():
    a = torch.randn(1, 128)
    b = torch.randn(1, 128)
    return [a, b]


def get_init_inputs():
    return []
'''

# KernelBench's candidate style, the one DICE's checkpoints and data use.
EXAMPLE_LOAD_INLINE = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>

__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    int64_t n = a.numel();
    const int threads = 256;
    const int64_t blocks = (n + threads - 1) / threads;
    add_kernel<<<blocks, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

cpp_src = "torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b);"

add_ops = load_inline(
    name="add_ops",
    cpp_sources=cpp_src,
    cuda_sources=source,
    functions=["add_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        return add_ops.add_cuda(a.contiguous(), b.contiguous())
'''

# The project's fast style: NVRTC compiles the kernel in ~50 ms instead of a ~60 s C++ build.
# CuPy passes a Python int (a tensor's data_ptr()) as an 8-byte integer, which is what a
# pointer parameter takes; other integer parameters need a NumPy/CuPy scalar of their C type.
EXAMPLE_CUPY = """\
import torch
import torch.nn as nn
import cupy as cp

_source = r'''
extern "C" __global__ void add_kernel(const float* a, const float* b, float* out, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
'''
_add = cp.RawModule(code=_source).get_function("add_kernel")


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        n = a.numel()
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _add(((n + 255) // 256,), (256,), (a.data_ptr(), b.data_ptr(), out.data_ptr(), cp.int64(n)))
        return out
"""

ONE_SHOT_EXAMPLES = {
    "load_inline": (
        "embedding custom CUDA kernels in PyTorch with torch.utils.cpp_extension.load_inline",
        EXAMPLE_LOAD_INLINE,
    ),
    "cupy": (
        "custom CUDA kernels compiled at run time with cupy.RawModule and launched on the "
        "memory of PyTorch tensors",
        EXAMPLE_CUPY,
    ),
}


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# DICE's SFT answers: hiyouga/LLaMA-Factory `src/llamafactory/data/template.py`, template qwen3 (a
# ReasoningTemplate), adds this empty thought to the trained response when thinking is on (its default)
EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


# The user turn and the assistant turn's opening around the user text (DESIGN.md §6). chatml: as the
# SDAR/Qwen3 chat template and LLaMA-Factory's qwen3 template write them, so DICE's SFT data and its
# KernelBench evaluation (evaluation/src/utils.py: `apply_chat_template(..., add_generation_prompt=True)`);
# dice: DICE's RL rollout prompts, a space before <|im_end|> and two newlines after `assistant`
# (training/RL/sample/sdar_rl_rollout_kernel.py: PROBLEM_INSTRUCTION, line 49, and
# KERNEL_INFILLING_SYSTEM_PROMPT, line 258), which DICE's checkpoints were reinforced on.
CHAT_FORMATS = {
    "chatml": f"{IM_START}user\n{{user}}{IM_END}\n{IM_START}assistant\n",
    "dice": f"{IM_START}user\n{{user}} {IM_END}\n{IM_START}assistant\n\n",
}


def chat_prompt(user_text: str, chat: str = "chatml") -> str:
    """A user turn followed by the opening of the assistant's turn, in `CHAT_FORMATS[chat]`
    (DESIGN.md §4, §6)."""
    return CHAT_FORMATS[chat].format(user=user_text)


def chat_response(text: str, think: bool = False) -> str:
    """The assistant side of a training example: the answer closed by <|im_end|>; with `think`,
    DICE's format (DESIGN.md §4; LLaMA-Factory's qwen3 template: `<think>\n\n</think>\n\n` + answer
    + `<|im_end|>\n`, all of it trained; DICE's SFT configs use `template: qwen3`)."""
    return f"{EMPTY_THINK}{text}{IM_END}\n" if think else f"{text}{IM_END}"


def thinks(tokenizer) -> bool:
    """Whether a model is trained with DICE's think block: its chat template writes <think> (SDAR's
    and DICE's, Qwen3's), or, when the folder has no template, its vocabulary has a <think> token.
    Models trained from scratch here (dice-tiny) have neither."""
    if tokenizer.chat_template:
        return THINK_OPEN in tokenizer.chat_template
    return tokenizer.token_to_id(THINK_OPEN) is not None


def kernel_prompt(
    task_src: str,
    *,
    prefix: str | None = None,
    suffix: str | None = None,
    one_shot: str | None = "load_inline",
) -> str:
    """The user text asking for a `ModelNew` that speeds up the `Model` of `task_src` (§6).

    one_shot: the style of the worked example, "load_inline" (what DICE's checkpoints were
    trained on), "cupy", or None for no example (short prompts for small models).
    prefix, suffix: give both for an infilling prompt; the answer must then be the complete
    program prefix + middle + suffix, with the middle written where INFILL_GAP stands.
    """
    if (prefix is None) != (suffix is None):
        raise ValueError("kernel_prompt: give both prefix and suffix for an infilling prompt, or neither")
    if one_shot is not None and one_shot not in ONE_SHOT_EXAMPLES:
        raise ValueError(
            f"kernel_prompt: unknown one_shot={one_shot!r}; use one of {sorted(ONE_SHOT_EXAMPLES)} or None"
        )
    parts = [INSTRUCTION]
    if one_shot is not None:
        syntax, example = ONE_SHOT_EXAMPLES[one_shot]
        parts.append(
            f"Here is an example of the syntax of {syntax}. The example's architecture is:\n\n"
            f"{_fenced(EXAMPLE_MODEL)}\n"
            f"The same architecture optimized with a custom CUDA kernel:\n\n{_fenced(example)}"
        )
    parts.append(f"You are given the following architecture:\n\n{_fenced(task_src)}")
    if prefix is None:
        parts.append(REQUEST)
    else:
        parts.append(
            "Complete this skeleton of the solution. Keep its code as it is and write the missing "
            f"part, the CUDA source, where the line `{INFILL_GAP}` stands:\n\n"
            f"{_fenced(prefix + INFILL_GAP + suffix)}"
        )
        parts.append(f"{REQUEST} {INFILL_REQUEST}")
    return "\n".join(parts)


@dataclass(frozen=True)
class PromptFormat:
    """How a task becomes the model's input text: `kernel_prompt` with the `one_shot` example in
    the `chat` turn, or, when `template` is given, that text with the task filled in (`fill_template`)."""
    one_shot: str | None = "load_inline"
    chat: str = "chatml"
    template: str | None = None

    def text(self, task_src: str, prefix: str | None = None, suffix: str | None = None) -> str:
        if self.template is not None:
            return fill_template(self.template, task_src, prefix, suffix)
        return chat_prompt(kernel_prompt(task_src, prefix=prefix, suffix=suffix, one_shot=self.one_shot), self.chat)


# A prompt template is the model's whole input text, chat markup included, with these placeholders
# (DICE's own names: sdar_rl_rollout_kernel.py renders {{pytorch_code}}, {{prefix}}, {{suffix}}).
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
TEMPLATE_FIELDS = ("pytorch_code", "prefix", "suffix")


def template_problem(template: str, infill: bool) -> str | None:
    """What keeps `template` from being an end-to-end (or, with `infill`, an infilling) prompt
    template: an unknown placeholder, or a missing or extra one; None when it is one."""
    names = set(_PLACEHOLDER.findall(template))
    needed = {"pytorch_code", "prefix", "suffix"} if infill else {"pytorch_code"}
    unknown = sorted(names - set(TEMPLATE_FIELDS))
    if unknown:
        return (f"it has the placeholder {{{{{unknown[0]}}}}}; the placeholders are "
                + ", ".join(f"{{{{{n}}}}}" for n in TEMPLATE_FIELDS))
    if needed - names:
        kind = "an infilling" if infill else "an end-to-end"
        return f"{kind} prompt needs " + " and ".join(f"{{{{{n}}}}}" for n in sorted(needed - names))
    if names - needed:
        return ("an end-to-end prompt has no skeleton, so no {{prefix}} or {{suffix}}; use it with --infill "
                "(--phase infill) or remove them")
    return None


def fill_template(template: str, task_src: str, prefix: str | None = None, suffix: str | None = None) -> str:
    """`template` with {{pytorch_code}} replaced by the task's source and {{prefix}} / {{suffix}} by
    its skeleton, each in one pass (text filled in is never read for placeholders again)."""
    values = {"pytorch_code": task_src, "prefix": prefix or "", "suffix": suffix or ""}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _fenced(code: str) -> str:
    body = code.lstrip("\n").rstrip()
    return f"```python\n{body}\n```\n"


# An opening fence with any info string (```python, ```cpp, ```cuda, ``` ...), then the code up
# to a closing fence that starts a line or ends one (glued to the code: "    return y```"), or up
# to the end of a generation cut at max tokens.
_CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:^[ \t]*```|```[ \t]*$|\Z)", re.DOTALL | re.MULTILINE)


_THINK_BLOCK = re.compile(rf"\s*{THINK_OPEN}.*?{THINK_CLOSE}", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The first fenced code block of `response` after its leading think block, if it has one
    (DICE's answers start with one, empty), an unclosed block to the end; None without a block."""
    think = _THINK_BLOCK.match(response)
    match = _CODE_BLOCK.search(response, think.end() if think else 0)
    return None if match is None else match.group(1).rstrip()


def keeps_skeleton(program: str, prefix: str, suffix: str) -> bool:
    """Whether `program` starts with the lines of `prefix` and ends with the lines of `suffix`.

    Lines are compared without trailing whitespace, and blank lines at either end of the
    program, the prefix and the suffix do not count; nothing may follow the suffix (no
    `if __name__ == "__main__":` block). Prefix and suffix are compared as whole lines, so the
    gap between them must start and end at line boundaries, as in all DICE infilling tasks.
    """
    lines, head, tail = _code_lines(program), _code_lines(prefix), _code_lines(suffix)
    if len(head) + len(tail) > len(lines):
        return False
    return lines[: len(head)] == head and lines[len(lines) - len(tail):] == tail


def _code_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines
