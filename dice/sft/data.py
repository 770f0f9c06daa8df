"""SFT data: record readers, tokenisation, and packing into fixed-length rows (DESIGN.md §4).

Accepted records (a JSON list or JSONL, one object per line):
  {"prompt": ..., "response": ...}
  {"instruction": ..., "input": ..., "output": ...}           LLaMA-Factory alpaca
  {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}   the last turn is
                                                              the assistant's response
  {"pytorch_code": ..., "cuda_code": ...}                     a kernel task and its solution,
                                                              through the DICE prompt builder
Each becomes ChatML text `chat_prompt(user)` + `chat_response(answer, think)` (think: DICE's empty
think block first, for SDAR/DICE models, `dice.tasks.prompts.thinks`); prompt and response are tokenised
separately, as at inference, where the response starts right after the prompt.

Packing: every example is padded to a multiple of the block size (padding belongs to no
sample: it is never attended to and never trained, unless `with_pad_targets` made it DICE's
trained response end) and examples are laid greedily into rows of
`row_len` tokens, with position ids restarting at 0 per sample and `sample_ids` telling samples
apart, so no token attends across samples.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DataError, json_kind, json_problem, read_text
from ..tasks.prompts import chat_prompt, chat_response, kernel_prompt


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSON list or a JSONL file (one object per line; blank lines skipped); a line
    that does not parse is reported with its line number in the file."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {path} is a folder; pass --data FILE (.json or .jsonl records)")
    if not path.is_file():
        raise DataError(f"data file {path} not found; pass --data FILE (.json or .jsonl records)")
    text = read_text(path)
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is not valid JSONL ({json_problem(e, number)}); fix that line "
                                "(JSONL holds one record per line)") from None
            if line.strip() and not isinstance(record, dict):
                raise DataError(f"{path} line {number} holds {json_kind(record)}, where a record (a JSON object such "
                                "as {\"prompt\": ..., \"response\": ...}) was expected; write one record per line")
            records += [record] if line.strip() else []
        return records
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({json_problem(e)}); fix it there, "
                        "or write one record per line in a .jsonl file") from None
    if not isinstance(records, list):
        raise DataError(f"{path} must hold a JSON list of records (or be .jsonl with one record per line)")
    return records


def _messages_prompt(messages: list[dict]) -> tuple[str, str]:
    roles = [m.get("role") for m in messages]
    asked = [r for r in roles[:-1] if r != "system"]
    if len(roles) < 2 or roles[-1] != "assistant" or not asked or asked[-1] != "user":
        raise ValueError("its messages must end with a user turn answered by an assistant turn")
    *context, last = messages
    system = "".join(f"<|im_start|>system\n{m['content']}<|im_end|>\n" for m in context if m["role"] == "system")
    turns = [m for m in context if m["role"] != "system"]
    history = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns[:-1])
    return system + history + chat_prompt(turns[-1]["content"]), last["content"]


def record_to_text(record: dict, *, one_shot: str | None = "load_inline", infill: bool = False,
                   think: bool = False) -> tuple[str, str]:
    """(ChatML prompt text, response text ending with <|im_end|>) of one record; `infill` uses the
    infilling prompt (the record's prefix and suffix around the gap) for a kernel record, `think`
    DICE's response format (`dice.tasks.prompts.chat_response`)."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in messages):
            raise TypeError("its messages must be a list of objects with a role and a content string")
        prompt, answer = _messages_prompt(messages)
        return prompt, chat_response(answer, think)
    if "pytorch_code" in record:
        if not record.get("cuda_code") or (isinstance(record["cuda_code"], str) and not record["cuda_code"].strip()):
            # DICE's end-to-end RL file: tasks without solutions
            raise ValueError("it has a pytorch_code task but no cuda_code solution (or an empty one): a task for "
                             "RL (--phase e2e), not an SFT example; add its solution as cuda_code or leave it out")
        fields = ("pytorch_code", "cuda_code") + (("prefix", "suffix") if infill else ())
        user_text, code = _strings(record, fields)[:2]
        skeleton = dict(zip(("prefix", "suffix"), _strings(record, ("prefix", "suffix")))) if infill else {}
        user = kernel_prompt(user_text, one_shot=one_shot, **skeleton)
        answer = f"```python\n{code.strip()}\n```"
    elif "instruction" in record:
        instruction, answer = _strings(record, ("instruction", "output"))
        extra = _strings(record, ("input",))[0] if record.get("input") else ""
        user = instruction + (f"\n\n{extra}" if extra else "")
    else:
        user, answer = _strings(record, ("prompt", "response"))
    return chat_prompt(user), chat_response(answer, think)


def _strings(record: dict, keys: tuple[str, ...]) -> list[str]:
    """The record's values of `keys`; a missing key is a KeyError, a value that is no string a TypeError."""
    values = [record[key] for key in keys]
    for key, value in zip(keys, values):
        if not isinstance(value, str):
            raise TypeError(f"its {key} must be a string, not {json_kind(value, shown=True)}")
    return values


def record_texts(record: dict, where: str, *, one_shot: str | None = "load_inline",
                 infill_copies: bool = False, think: bool = False) -> list[tuple[str, str]]:
    """`record_to_text` of a record, plus its infilling copy with `infill_copies` (see
    `tokenize_records`); a record of no known format is a DataError naming `where`."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is {json_kind(record)}, where a record (a JSON object) was expected; write each "
                        "record as an object such as {\"prompt\": ..., \"response\": ...}")
    try:
        texts = [record_to_text(record, one_shot=one_shot, think=think)]
        if infill_copies and "prefix" in record and "cuda_code" in record:
            texts.append(record_to_text(record, one_shot=one_shot, infill=True, think=think))
    except KeyError as e:
        raise DataError(f"{where} is not a prompt/response, alpaca, messages or pytorch_code/cuda_code "
                        f"record (it has no {e}); fix the record or leave it out") from None
    except (TypeError, ValueError) as e:
        raise DataError(f"{where} is not usable: {e}") from None
    return texts


@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]


def tokenize_records(records: list[dict], tokenizer, max_len: int, *, source: str = "data",
                     one_shot: str | None = "load_inline", infill_copies: bool = False,
                     think: bool = False) -> tuple[list[Example], int]:
    """Tokenise records. With `infill_copies`, kernel records that carry a prefix/middle/suffix
    split are also taught under the infilling prompt (the prompt of BiC-RL's first phase).
    Returns (examples, number of examples skipped because prompt + response exceed `max_len`:
    a cut response would teach a program without its end and without <|im_end|>)."""
    examples, skipped = [], 0
    for i, record in enumerate(records):
        for prompt, response in record_texts(record, f"{source}: record {i}", one_shot=one_shot,
                                             infill_copies=infill_copies, think=think):
            p, r = tokenizer.encode(prompt), tokenizer.encode(response)
            if len(p) + len(r) > max_len:
                skipped += 1
                continue
            examples.append(Example(p, r))
    return examples, skipped


def with_pad_targets(examples: list[Example], block_size: int, pad_id: int) -> list[Example]:
    """DICE's SFT examples (`--sft-pad-targets`): the response extended with pad tokens until the
    example fills whole blocks, the pads trained like the rest of the response (attended within
    their sample, masked, counted in the loss and its normaliser), so the model learns to fill the
    last block after its end. DICE's LLaMA-Factory fork does this to every example
    (training/sft/llama_factory_sdar/src/llamafactory/data/processor/supervised.py, lines 88-92:
    `labels += [pad_token_id] * pad_len`); by default pads belong to no sample and are never trained."""
    pads = [-(len(e.prompt_ids) + len(e.response_ids)) % block_size for e in examples]
    return [Example(e.prompt_ids, e.response_ids + [pad_id] * n) for e, n in zip(examples, pads)]


def pack_rows(examples: list[Example], row_len: int, block_size: int, pad_id: int) -> list[dict]:
    """Greedy packing in the given order into rows of `row_len` tokens (see module docstring)."""
    if row_len % block_size:
        raise ValueError(f"row length {row_len} must be a multiple of the block size {block_size}")
    rows, current = [], []
    used = 0
    for ex in examples:
        n = len(ex.prompt_ids) + len(ex.response_ids)
        padded = -(-n // block_size) * block_size
        if current and used + padded > row_len:
            rows.append(_row(current, row_len, block_size, pad_id))
            current, used = [], 0
        current.append(ex)
        used += padded
    if current:
        rows.append(_row(current, row_len, block_size, pad_id))
    return rows


def _row(examples: list[Example], row_len: int, block_size: int, pad_id: int) -> dict:
    ids = torch.full((row_len,), pad_id, dtype=torch.long)
    pos = torch.zeros(row_len, dtype=torch.long)
    sample = torch.full((row_len,), -1, dtype=torch.long)
    loss = torch.zeros(row_len, dtype=torch.bool)
    start = 0
    for k, ex in enumerate(examples):
        toks = ex.prompt_ids + ex.response_ids
        n, padded = len(toks), -(-len(toks) // block_size) * block_size
        ids[start:start + n] = torch.tensor(toks)
        pos[start:start + padded] = torch.arange(padded)
        sample[start:start + n] = k
        loss[start + len(ex.prompt_ids):start + n] = True
        start += padded
    return {"input_ids": ids, "position_ids": pos, "sample_ids": sample, "loss_mask": loss}


def collate(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class RowStream:
    """An endless, reproducible stream of packed rows: epoch e packs the examples shuffled with
    seed + e, so row k of the stream depends only on (examples, seed, k) and training resumes
    on exactly the data it would have seen."""

    def __init__(self, examples: list[Example], row_len: int, block_size: int, pad_id: int, seed: int):
        self.examples, self.row_len, self.block_size, self.pad_id, self.seed = examples, row_len, block_size, pad_id, seed
        self._lengths: dict[int, int] = {}
        self._cached: tuple[int, list[dict]] = (-1, [])

    def epoch_rows(self, epoch: int) -> list[dict]:
        if self._cached[0] != epoch:
            order = list(range(len(self.examples)))
            random.Random(self.seed + epoch).shuffle(order)
            rows = pack_rows([self.examples[i] for i in order], self.row_len, self.block_size, self.pad_id)
            self._cached, self._lengths[epoch] = (epoch, rows), len(rows)
        return self._cached[1]

    def epoch_length(self, epoch: int) -> int:
        if epoch not in self._lengths:
            self.epoch_rows(epoch)
        return self._lengths[epoch]

    def rows(self, start: int, count: int) -> list[dict]:
        """Rows [start, start + count) of the stream."""
        epoch, offset = 0, start
        while self.epoch_length(epoch) <= offset:
            offset -= self.epoch_length(epoch)
            epoch += 1
        out = []
        while len(out) < count:
            rows = self.epoch_rows(epoch)
            take = rows[offset:offset + count - len(out)]
            out.extend(take)
            offset += len(take)
            if offset >= len(rows):
                epoch, offset = epoch + 1, 0
        return out
