"""SFT record readers, ChatML formatting and packing."""
import json

import pytest
import torch

from dice.errors import DataError
from dice.sft.data import (Example, RowStream, pack_rows, read_records, record_to_text, tokenize_records,
                           with_pad_targets)


def test_record_formats_become_chatml():
    expect = ("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", "A<|im_end|>")
    assert record_to_text({"prompt": "Q", "response": "A"}) == expect
    assert record_to_text({"instruction": "Q", "input": "", "output": "A"}) == expect
    assert record_to_text({"instruction": "Q", "input": "x", "output": "A"})[0].startswith(
        "<|im_start|>user\nQ\n\nx<|im_end|>")
    msgs = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                         {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q"},
                         {"role": "assistant", "content": "A"}]}
    assert record_to_text(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
                                    "<|im_start|>assistant\nA1<|im_end|>\n" + expect[0], expect[1])
    prompt, response = record_to_text({"pytorch_code": "class Model: pass", "cuda_code": "class ModelNew: pass"},
                                      one_shot=None)
    assert "class Model: pass" in prompt and response == "```python\nclass ModelNew: pass\n```<|im_end|>"


def test_infill_copies_teach_the_skeleton_prompt():
    record = {"pytorch_code": "class Model: pass", "cuda_code": "import a\nMID\nclass ModelNew: pass",
              "prefix": "import a\n", "middle": "MID", "suffix": "\nclass ModelNew: pass"}

    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    plain, _ = tokenize_records([record], Chars(), 10_000, one_shot=None)
    both, _ = tokenize_records([record], Chars(), 10_000, one_shot=None, infill_copies=True)
    assert len(plain) == 1 and len(both) == 2 and both[0] == plain[0]
    infill_prompt = "".join(map(chr, both[1].prompt_ids))
    assert "import a" in infill_prompt and "class ModelNew: pass" in infill_prompt
    assert both[1].response_ids == plain[0].response_ids


def test_json_and_jsonl_and_bad_records(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "Q", "response": "A"}]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "Q", "response": "A"}\n\n{"foo": 1}\n')
    assert read_records(tmp_path / "a.json") == [{"prompt": "Q", "response": "A"}]
    records = read_records(tmp_path / "b.jsonl")

    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    with pytest.raises(DataError, match=r"b.jsonl: record 1 is not a prompt/response"):
        tokenize_records(records, Chars(), 100, source=str(tmp_path / "b.jsonl"))
    (tmp_path / "c.json").write_text("{broken")
    with pytest.raises(DataError, match="c.json is not valid JSON"):
        read_records(tmp_path / "c.json")
    with pytest.raises(DataError, match="not found"):
        read_records(tmp_path / "nope.json")


class Chars:
    """A tokenizer with one id per character."""

    def encode(self, text):
        return [ord(c) for c in text]


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}],   # no user turn
    [{"role": "assistant", "content": "A"}],
    [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A1"},
     {"role": "assistant", "content": "A2"}],       # A1 would be rendered as the user's turn
    [],
])
def test_messages_without_a_last_user_turn_are_a_data_error(messages):
    with pytest.raises(DataError, match=r"d.jsonl: record 0 is not .* must end with a user turn answered"):
        tokenize_records([{"messages": messages}], Chars(), 100, source="d.jsonl")


@pytest.mark.parametrize("record, text", [
    ({"pytorch_code": "class Model: pass", "cuda_code": "  \n"}, "no cuda_code solution"),   # DICE's e2e RL file
    ({"pytorch_code": "class Model: pass"}, r"record 0 is not usable: it has a pytorch_code task but no cuda_code"),
    ({"prompt": None, "response": None}, "is not usable: its prompt must be a string, not null$"),
])
def test_records_without_a_real_answer_are_a_data_error(record, text):
    with pytest.raises(DataError, match=text):
        tokenize_records([record], Chars(), 10_000, source="d.json")


def test_examples_longer_than_max_len_are_skipped_not_cut():
    records = [{"prompt": "p", "response": "r" * 10}, {"prompt": "p", "response": "r" * 200}]
    examples, skipped = tokenize_records(records, Chars(), 100)
    assert skipped == 1 and len(examples) == 1
    ex = examples[0]
    assert len(ex.prompt_ids) + len(ex.response_ids) <= 100 and ex.response_ids[-1:] == Chars().encode(">")


def test_an_example_of_exactly_max_len_tokens_is_kept():
    record = {"prompt": "p", "response": "r"}
    n = sum(len(Chars().encode(t)) for t in record_to_text(record))
    assert tokenize_records([record], Chars(), n)[1] == 0 and tokenize_records([record], Chars(), n - 1)[1] == 1


def test_kernel_answers_are_stripped_and_only_kernel_records_get_infill_copies():
    _, response = record_to_text({"pytorch_code": "class Model: pass", "cuda_code": "\nx = 1\n\n"}, one_shot=None)
    assert response == "```python\nx = 1\n```<|im_end|>"
    stray = {"prompt": "Q", "response": "A", "prefix": "import a\n"}
    assert len(tokenize_records([stray], Chars(), 10_000, infill_copies=True)[0]) == 1


def test_packing_restarts_positions_and_pads_blocks():
    examples = [Example([1, 2], [3, 4, 5]), Example([6], [7, 8]), Example([9, 9, 9], [10] * 6)]
    rows = pack_rows(examples, row_len=12, block_size=4, pad_id=0)
    assert len(rows) == 2
    r = rows[0]
    assert r["input_ids"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 0]
    assert r["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert r["sample_ids"].tolist() == [0, 0, 0, 0, 0, -1, -1, -1, 1, 1, 1, -1]
    assert r["loss_mask"].tolist() == [False, False, True, True, True, False, False, False, False, True, True, False]
    assert rows[1]["sample_ids"].tolist() == [0] * 9 + [-1] * 3


def test_dice_pad_targets_are_trained_response_tokens_of_their_sample():
    """--sft-pad-targets (DICE's fork): prompt [1, 2], response [3, 4, 5] and pad 0 in blocks of 4 become a
    response [3, 4, 5, 0, 0, 0]; the pads are the sample's (attended) and in the loss; an example
    already on the block grid gets none."""
    padded = with_pad_targets([Example([1, 2], [3, 4, 5]), Example([6], [7, 8, 9])], block_size=4, pad_id=0)
    assert [(e.prompt_ids, e.response_ids) for e in padded] == [([1, 2], [3, 4, 5, 0, 0, 0]), ([6], [7, 8, 9])]
    r = pack_rows(padded, row_len=12, block_size=4, pad_id=0)[0]
    assert r["input_ids"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9]
    assert r["sample_ids"].tolist() == [0] * 8 + [1] * 4
    assert r["loss_mask"].tolist() == [False, False] + [True] * 6 + [False] + [True] * 3


def test_packing_counts_each_sample_padded_to_whole_blocks():
    # 5 + 7 tokens fit 12, but padded to blocks of 4 they take 8 + 8: two rows
    rows = pack_rows([Example([1], [2] * 4), Example([3], [4] * 6)], row_len=12, block_size=4, pad_id=0)
    assert [r["sample_ids"].tolist() for r in rows] == [[0] * 5 + [-1] * 7, [0] * 7 + [-1] * 5]


def test_row_stream_is_reproducible_across_epochs():
    examples = [Example([i], [i, i]) for i in range(10)]
    stream = RowStream(examples, 8, 4, 0, seed=3)
    n0, n1 = stream.epoch_length(0), stream.epoch_length(1)
    everything = stream.rows(0, n0 + n1)
    fresh = RowStream(examples, 8, 4, 0, seed=3)
    for start in (0, 3, n0 - 1, n0 + 1):
        got = fresh.rows(start, 2)
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, everything[start:start + 2]))
    assert not torch.equal(stream.epoch_rows(0)[0]["input_ids"], stream.epoch_rows(1)[0]["input_ids"]) or n0 == 1


def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path):
    """It was reported as `line 1 column 23` (of the line) when it was line 6 of the file."""
    good = json.dumps({"prompt": "Q", "response": "A"})
    (tmp_path / "d.jsonl").write_text("\n".join([good, "", good, good, good, '{"prompt": "Q", "response": A}']))
    with pytest.raises(DataError, match=r"d.jsonl is not valid JSONL \(Expecting value at line 6 column 29\); fix that line"):
        read_records(tmp_path / "d.jsonl")
    (tmp_path / "e.jsonl").write_text(good + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"e.jsonl line 2 holds a list, where a record \(a JSON object such as \{\"prompt\": \.\.\., \"response\": \.\.\.\}\) was expected; write one record per line"):
        read_records(tmp_path / "e.jsonl")
    (tmp_path / "n.jsonl").write_text("5\n")    # was "holds a int"
    with pytest.raises(DataError, match=r"n.jsonl line 1 holds a number, where a record \(a JSON object"):
        read_records(tmp_path / "n.jsonl")
    (tmp_path / "f.json").write_text('[\n{"prompt": "Q"},\n{"prompt" "Q"}]')
    with pytest.raises(DataError, match=r"f.json is not valid JSON \(Expecting ':' delimiter at line 3 column 11\)"):
        read_records(tmp_path / "f.json")


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "d.json").write_bytes(b'[{"prompt": "caf\xe9", "response": "A"}]')
    with pytest.raises(DataError, match=r"d.json is not UTF-8 text \(byte 16 is b'\\xe9'\); save it as UTF-8"):
        read_records(tmp_path / "d.json")


def test_dice_format_puts_an_empty_think_block_before_the_answer_and_a_newline_after_im_end():
    """DESIGN.md §4 (LLaMA-Factory's qwen3 template, thinking on), for every record kind."""
    think = "<think>\n\n</think>\n\n"
    assert record_to_text({"prompt": "Q", "response": "A"}, think=True) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", think + "A<|im_end|>\n")
    msgs = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    assert record_to_text(msgs, think=True)[1] == think + "A<|im_end|>\n"
    kernel = record_to_text({"pytorch_code": "class Model: pass", "cuda_code": "x = 1"}, one_shot=None, think=True)
    assert kernel[1] == think + "```python\nx = 1\n```<|im_end|>\n"
    assert record_to_text({"prompt": "Q", "response": "A"})[1] == "A<|im_end|>"      # the plain format
