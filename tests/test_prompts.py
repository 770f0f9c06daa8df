"""dice.tasks.prompts: the chat format (plain and DICE's think block), the kernel prompt, code extraction
and the skeleton check."""
import ast
import json
import shutil
from pathlib import Path

import pytest

from dice.model.tokenizer import load_tokenizer
from dice.sft.data import tokenize_records
from dice.tasks.prompts import (EXAMPLE_CUPY, EXAMPLE_LOAD_INLINE, EXAMPLE_MODEL, INFILL_GAP, REQUEST, chat_prompt,
                                chat_response, extract_code, keeps_skeleton, kernel_prompt, thinks)

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(16, 16)]


def get_init_inputs():
    return []
'''

# A solution split like DICE's infilling tasks: the prefix ends a line, the middle is the
# CUDA source, the suffix starts with the newline that ends the middle's last line.
PREFIX = "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
MIDDLE = 'source = """\n__global__ void relu_kernel(const float* x, float* y, int n) {}\n"""'
SUFFIX = (
    "\n\ncpp_src = \"torch::Tensor relu_cuda(torch::Tensor x);\"\n"
    "ops = load_inline(name='ops', cpp_sources=cpp_src, cuda_sources=source, functions=['relu_cuda'])\n\n"
    "class ModelNew(nn.Module):\n"
    "    def forward(self, x):\n"
    "        return ops.relu_cuda(x)"
)
PROGRAM = PREFIX + MIDDLE + SUFFIX


def test_chat_prompt_is_chatml():
    assert chat_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_response("```python\nx\n```") == "```python\nx\n```<|im_end|>"
    assert chat_response("```python\nx\n```", think=True) == "<think>\n\n</think>\n\n```python\nx\n```<|im_end|>\n"


def test_kernel_prompt_contains_the_task_and_the_request():
    prompt = kernel_prompt(TASK)
    assert prompt.startswith("You write custom CUDA kernels to replace the pytorch operators")
    assert TASK.rstrip() in prompt
    assert EXAMPLE_LOAD_INLINE.rstrip() in prompt
    assert prompt.endswith(REQUEST)
    assert INFILL_GAP not in prompt


def test_kernel_prompt_one_shot_styles():
    assert EXAMPLE_CUPY.rstrip() in kernel_prompt(TASK, one_shot="cupy")
    short = kernel_prompt(TASK, one_shot=None)
    assert "ModelNew" not in short.replace(REQUEST, "") and TASK.rstrip() in short
    with pytest.raises(ValueError, match="one_shot='triton'"):
        kernel_prompt(TASK, one_shot="triton")


@pytest.mark.parametrize("source", [EXAMPLE_MODEL, EXAMPLE_LOAD_INLINE, EXAMPLE_CUPY])
def test_one_shot_examples_are_valid_python(source):
    ast.parse(source)


def test_infilling_prompt_shows_the_skeleton():
    prompt = kernel_prompt(TASK, prefix=PREFIX, suffix=SUFFIX)
    assert TASK.rstrip() in prompt
    assert (PREFIX + INFILL_GAP + SUFFIX).strip() in prompt
    assert MIDDLE not in prompt
    assert REQUEST in prompt and "complete program" in prompt
    with pytest.raises(ValueError, match="both prefix and suffix"):
        kernel_prompt(TASK, prefix=PREFIX)


@pytest.mark.parametrize("response, code", [
    ("Here it is:\n```python\nimport torch\nx = 1\n```\nDone.", "import torch\nx = 1"),
    ("```cpp\n__global__ void k() {}\n```", "__global__ void k() {}"),
    ("```cuda\n__global__ void k() {}\n```", "__global__ void k() {}"),
    ("```\nplain = True\n```", "plain = True"),
    ("```python\nfirst = 1\n```\ntext\n```python\nsecond = 2\n```", "first = 1"),
    ("```python\nclass ModelNew:\n    pass\n", "class ModelNew:\n    pass"),  # cut at max tokens
    ("```python\n```", ""),
    ("```python\nclass ModelNew:\n    pass```\nHope this helps!", "class ModelNew:\n    pass"),  # glued fence
    ("No code here, only `inline` words.", None),
])
def test_extract_code(response, code):
    assert extract_code(response) == code


@pytest.mark.parametrize("response, code", [
    ("```py\nx = 1\n```", "x = 1"),                                   # any info string opens a block
    ("```c++\nint k;\n```", "int k;"),
    ("```python\n    indented = 1\nnext = 2\n```", "    indented = 1\nnext = 2"),   # first indent kept
])
def test_extract_code_keeps_any_fence_and_leading_indentation(response, code):
    assert extract_code(response) == code


def test_keeps_skeleton_with_an_empty_suffix_or_an_empty_middle():
    assert keeps_skeleton("import a\nMID", "import a\n", "")
    assert not keeps_skeleton("import b\nMID", "import a\n", "")
    assert keeps_skeleton("a\nb", "a\n", "\nb")                        # nothing between the two ends


def test_keeps_skeleton_accepts_the_reference_and_other_middles():
    assert keeps_skeleton(PROGRAM, PREFIX, SUFFIX)
    assert keeps_skeleton(PREFIX + 'source = r"""\n// a different kernel\n"""\n' + SUFFIX, PREFIX, SUFFIX)


def test_keeps_skeleton_tolerates_whitespace_at_line_ends_and_blank_edges():
    spaced = "\n\n" + PROGRAM.replace("\n", "   \r\n") + "\n\n\n"
    assert keeps_skeleton(spaced, PREFIX, SUFFIX)
    assert keeps_skeleton(extract_code(f"```python\n{PROGRAM}\n```"), PREFIX, SUFFIX)


@pytest.mark.parametrize("program", [
    PROGRAM.replace("import torch.nn as nn", "import torch.nn as neural"),  # prefix changed
    PROGRAM.replace("return ops.relu_cuda(x)", "return torch.relu(x)"),  # suffix changed
    "import numpy\n" + PROGRAM,  # code before the prefix
    PROGRAM + "\n\nif __name__ == '__main__':\n    print(ModelNew())\n",  # code after the suffix
    PROGRAM.replace("        return ops", "    return ops"),  # indentation is not trailing space
    MIDDLE,  # no skeleton at all
    "",
])
def test_keeps_skeleton_rejects_changes(program):
    assert not keeps_skeleton(program, PREFIX, SUFFIX)


def test_keeps_skeleton_needs_room_for_both_ends():
    # A program as long as the prefix alone cannot also end with the suffix.
    assert not keeps_skeleton(PREFIX, PREFIX, SUFFIX)
    assert keeps_skeleton(PREFIX + SUFFIX, PREFIX, SUFFIX)


@pytest.mark.parametrize("response, code", [
    ("<think>\n\n</think>\n\n```python\nx = 1\n```", "x = 1"),                         # DICE's empty think block
    ("<think>\nlike ```python\nwrong = 1\n```\n</think>\n\n```python\nright = 2\n```", "right = 2"),
    ("<think>\nunclosed, cut at max tokens", None),
])
def test_extract_code_reads_the_answer_after_a_think_block(response, code):
    assert extract_code(response) == code


FIXTURES = Path(__file__).parent / "fixtures"
DICE_TINY = Path(__file__).resolve().parents[1] / "dice" / "assets" / "dice-tiny"


def tokenizer_folder(tmp_path, **files):
    """dice-tiny's tokenizer files plus `files` (name -> text)."""
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json"):
        shutil.copy(DICE_TINY / name, folder / name)
    for name, text in files.items():
        (folder / name.replace("_jinja", ".jinja").replace("_json", ".json")).write_text(text)
    return folder


def test_sdar_chat_template_gives_dice_formatted_sft_answers(tmp_path):
    """An SDAR/DICE folder (Qwen3's chat template, copied from SDAR-8B-Chat) trains answers after an
    empty think block and with a newline after <|im_end|>, through the one prompt builder."""
    sdar = load_tokenizer(tokenizer_folder(tmp_path, chat_template_jinja=(FIXTURES / "sdar-chat" /
                                                                          "chat_template.jinja").read_text()))
    assert thinks(sdar) and not thinks(load_tokenizer(DICE_TINY))
    record = {"pytorch_code": TASK, "cuda_code": "x = 1"}
    (example,), _ = tokenize_records([record], sdar, 100_000, one_shot=None, think=thinks(sdar))
    assert sdar.decode(example.response_ids) == "<think>\n\n</think>\n\n```python\nx = 1\n```<|im_end|>\n"
    assert sdar.decode(example.prompt_ids) == chat_prompt(kernel_prompt(TASK, one_shot=None))


def test_think_format_is_read_from_tokenizer_config_or_else_the_vocabulary(tmp_path):
    config = json.loads((DICE_TINY / "tokenizer_config.json").read_text())
    in_config = tokenizer_folder(tmp_path / "a", tokenizer_config_json=json.dumps(
        {**config, "chat_template": "{{ '<|im_start|>assistant\\n<think>\\n' }}"}))
    assert thinks(load_tokenizer(in_config))
    plain_template = tokenizer_folder(tmp_path / "b", chat_template_jinja="{{ '<|im_start|>assistant\\n' }}")
    assert not thinks(load_tokenizer(plain_template))
    tok = load_tokenizer(DICE_TINY)           # no template: a <think> token decides
    tok.backend.add_special_tokens(["<think>"])
    tok.save(tmp_path / "c")
    assert thinks(load_tokenizer(tmp_path / "c"))


# ---------------------------------------------------------------- DICE's RL chat shape and templates

def test_dice_chat_shape_is_dices_rollout_prompt():
    """training/RL/sample/sdar_rl_rollout_kernel.py ends both its prompts with
    ` <|im_end|>\\n<|im_start|>assistant\\n\\n` (a space, then two newlines); ChatML has neither."""
    assert chat_prompt("Hi", "dice") == "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n\n"
    assert chat_prompt("Hi", "chatml") == chat_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt("{x} {user}", "dice").startswith("<|im_start|>user\n{x} {user} <|im_end|>")


def test_sdar_and_dice_folders_are_asked_in_dices_shape_and_our_models_in_chatml():
    from types import SimpleNamespace

    from dice.sampling.completion import prompt_format, task_prompt_ids
    from dice.tasks.load import Task
    sdar, ours = (SimpleNamespace(config=SimpleNamespace(extra=extra)) for extra in ({}, {"dice_one_shot": None}))
    assert (prompt_format(sdar).chat, prompt_format(sdar).one_shot) == ("dice", "load_inline")
    assert (prompt_format(ours).chat, prompt_format(ours).one_shot) == ("chatml", None)
    assert prompt_format(sdar, chat="chatml").chat == "chatml"
    tok = load_tokenizer(DICE_TINY)
    ids = task_prompt_ids(tok, Task("t", 1, TASK), fmt=prompt_format(sdar))
    assert tok.decode(ids) == chat_prompt(kernel_prompt(TASK), "dice")


DICE_LIKE_INFILL = ("<|im_start|>user\nGiven:\n```\n{{pytorch_code}}\n``` \n\nPrefix:\n```\n{{prefix}}\n```\n"
                    "Suffix:\n```\n{{ suffix }}\n``` \nComplete it! <|im_end|>\n<|im_start|>assistant\n")


def test_a_template_is_the_whole_prompt_with_the_task_filled_in_once():
    from dice.tasks.prompts import PromptFormat, fill_template
    text = PromptFormat(template=DICE_LIKE_INFILL).text("class Model: {{prefix}}", "import a\n", "\nclass ModelNew")
    assert text == ("<|im_start|>user\nGiven:\n```\nclass Model: {{prefix}}\n``` \n\nPrefix:\n```\nimport a\n\n```\n"
                    "Suffix:\n```\n\nclass ModelNew\n``` \nComplete it! <|im_end|>\n<|im_start|>assistant\n")
    assert fill_template("<<{{pytorch_code}}>>", "src") == "<<src>>"


@pytest.mark.parametrize("template, infill, problem", [
    ("{{pytorch_code}}", False, None), (DICE_LIKE_INFILL, True, None),
    ("no placeholder", False, "an end-to-end prompt needs {{pytorch_code}}"),
    ("{{pytorch_code}} {{prefix}}", True, "an infilling prompt needs {{suffix}}"),
    (DICE_LIKE_INFILL, False, "an end-to-end prompt has no skeleton, so no {{prefix}} or {{suffix}}"),
    ("{{pytorch_code}} {{problem}}", False, "it has the placeholder {{problem}}; the placeholders are"),
])
def test_template_problems(template, infill, problem):
    from dice.tasks.prompts import template_problem
    got = template_problem(template, infill)
    assert got == problem if problem is None else problem in got


def test_a_template_file_that_does_not_fit_is_one_line_naming_it(tmp_path):
    import sys

    from dice.errors import DataError
    from dice.sampling.completion import load_prompt_template
    good = tmp_path / "e2e.txt"
    good.write_text("<|im_start|>user\n{{pytorch_code}} <|im_end|>\n<|im_start|>assistant\n\n")
    assert load_prompt_template(str(good), infill=False) == good.read_text()
    with pytest.raises(DataError, match=f"--prompt-template {good}: an infilling prompt needs"):
        load_prompt_template(str(good), infill=True)
    with pytest.raises(DataError, match="no such file"):
        load_prompt_template(str(tmp_path / "missing.txt"), infill=False)
    bad = tmp_path / "bad.txt"
    bad.write_text("{{pytorch_code}} {{problem}}")
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    import sample
    from dice.cli import fail_cleanly
    task = DICE_TINY.parents[1] / "assets" / "examples" / "level1_leaky_relu.py"
    with pytest.raises(SystemExit) as stop:   # before the model loads
        fail_cleanly(lambda: sample.main(["--prompt", str(task), "--prompt-template", str(bad)]))
    assert str(stop.value.code) == (f"error: --prompt-template {bad}: it has the placeholder {{{{problem}}}}; the "
                                    "placeholders are {{pytorch_code}}, {{prefix}}, {{suffix}}")


@pytest.mark.slow
def test_rl_rollouts_ask_with_the_template(tmp_path, monkeypatch):
    import dice.rl.rollout
    import dice.rl.train_rl
    from dice.config import TrainConfig

    from test_rl import TASKS, rl_model_folder
    template = tmp_path / "t.txt"
    template.write_text("<|im_start|>user\nSpeed up:\n{{pytorch_code}} <|im_end|>\n<|im_start|>assistant\n\n")
    asked = []

    class Stop(Exception):
        pass

    def capture(policy, tok, prompts, *args, **kwargs):
        asked.extend(tok.decode(p) for p in prompts)
        raise Stop

    monkeypatch.setattr(dice.rl.rollout, "generate_and_score", capture)
    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "out"),
                      steps=1, tasks_per_step=1, group_size=2, prompt_template=str(template))
    with pytest.raises(Stop):
        dice.rl.train_rl.train_rl(cfg, reward_fn=lambda tasks, completions: [0.0] * len(completions), tasks=TASKS[:1])
    assert asked == [f"<|im_start|>user\nSpeed up:\n{TASKS[0].source} <|im_end|>\n<|im_start|>assistant\n\n"] * 2
