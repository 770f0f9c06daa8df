"""dice.model.tokenizer: both ways of loading a byte-level BPE folder agree, ids DICE needs, training.

The default suite builds its own small Qwen2-style folder. The SDAR tokenizer is checked
against golden encodings only on request:
    DICE_TOKENIZER_DIR=path/to/sdar-chat pytest tests/test_tokenizer.py
(the folder holds tokenizer.json, vocab.json, merges.txt, added_tokens.json and
tokenizer_golden.json = {"cases": [{"text", "ids", "decoded"}]}).
"""
import json
import os
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from dice.model.tokenizer import (ENDOFTEXT, IM_END, IM_START, QWEN2_SPLIT_PATTERN, SPECIAL_TOKENS, TokenizerError,
                                  load_tokenizer, train_tokenizer)

CORPUS = [
    "import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n",
    "__global__ void add_kernel(const float* a, const float* b, float* out, int n) {\n    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) out[i] = a[i] + b[i];\n}\n",
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see 1234567 foxes.\r\n",
    "Unicode: 内核 生成 — émoji 🚀, café, naïve.\tTabs\t\tand   spaces  \n\n\n",
]

TEXTS = [
    "Hello, world!",
    "   leading spaces and 12345678901234 digits",
    "line one\r\nline two\r\n\r\n",
    "Unicode: 内核 生成 — émoji 🚀 tabs\t\tand   spaces",
    "cafe\u0301 is NFC-normalised to café",
    "<|im_start|>user\nWrite a CUDA kernel.<|im_end|>\n<|im_start|>assistant\n<MASK><MASK>x<|endoftext|>",
    "<think>\n\n</think>\n\nint main() { return 0; }",
    "",
]

# Added tokens after the BPE vocabulary, as in Qwen2 folders; the mask has two spellings (SDAR).
ADDED = [ENDOFTEXT, IM_START, IM_END, "<think>", "<MASK>"]


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _make_folder(root: Path) -> Path:
    """A Qwen2-style tokenizer folder: vocab.json, merges.txt, added_tokens.json,
    tokenizer_config.json and a tokenizer.json laid out like SDAR's (built here independently)."""
    bpe = Backend(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    vocab, merges = model["vocab"], [" ".join(pair) for pair in model["merges"]]
    ids = {name: len(vocab) + k for k, name in enumerate(ADDED)}

    folder = root / "bpe"
    folder.mkdir()
    _write_json(folder / "vocab.json", vocab)
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    _write_json(folder / "added_tokens.json", ids)
    decoder = {str(i): {"content": "<|MASK|>" if name == "<MASK>" else name, "special": True}
               for name, i in ids.items()}
    _write_json(folder / "tokenizer_config.json", {"added_tokens_decoder": decoder})
    _write_json(folder / "tokenizer.json", {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for name, i in ids.items()
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_PATTERN}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    })
    return folder


def _without_tokenizer_json(folder: Path, root: Path) -> Path:
    copy = root / (folder.name + "-vocab-merges")
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("tokenizer.json"))
    return copy


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return _make_folder(tmp_path)


def test_both_loading_paths_agree(folder: Path, tmp_path: Path):
    from_json = load_tokenizer(folder)
    from_files = load_tokenizer(_without_tokenizer_json(folder, tmp_path))
    assert from_json.vocab_size == from_files.vocab_size == 400 + len(ADDED)
    for text in TEXTS:
        ids = from_json.encode(text)
        assert from_files.encode(text) == ids, text
        assert from_json.decode(ids) == from_files.decode(ids) == text.replace("e\u0301", "é")


def test_special_tokens_are_single_ids(folder: Path):
    tok = load_tokenizer(folder)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.im_start_id == 401 and ids[-1] == tok.im_end_id == 402
    assert tok.decode([tok.im_start_id]) == IM_START


def test_both_mask_spellings_encode_to_the_mask_id(folder: Path, tmp_path: Path):
    for tok in (load_tokenizer(folder), load_tokenizer(_without_tokenizer_json(folder, tmp_path))):
        assert tok.mask_token_id == 404
        assert tok.encode("<MASK><|MASK|> <|MASK|>") == [404, 404, tok.encode(" ")[0], 404]
        assert tok.token_to_id("<|MASK|>") == tok.token_to_id("<MASK>") == 404
        assert tok.decode([404]) == "<MASK>"


def test_ids_dice_needs(folder: Path):
    tok = load_tokenizer(folder)
    assert tok.pad_token_id == 400
    assert tok.eos_token_ids == (402, 400)
    assert tok.token_to_id("no such token") is None


def test_mask_id_comes_from_config_json(folder: Path):
    _write_json(folder / "config.json", {"mask_token_id": 403})
    assert load_tokenizer(folder).mask_token_id == 403


def test_missing_mask_token_is_a_clear_error(folder: Path):
    _write_json(folder / "added_tokens.json", {})
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<MASK>"]
    _write_json(folder / "tokenizer.json", spec)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["added_tokens_decoder"]["404"]
    _write_json(folder / "tokenizer_config.json", config)
    tok = load_tokenizer(folder)
    with pytest.raises(TokenizerError, match="mask_token_id"):
        tok.mask_token_id


def test_missing_folder_is_a_clear_error(tmp_path: Path):
    with pytest.raises(TokenizerError, match="does not exist.*tokenizer.json.*vocab.json"):
        load_tokenizer(tmp_path / "nowhere")


def test_folder_without_merges_is_a_clear_error(folder: Path, tmp_path: Path):
    copy = _without_tokenizer_json(folder, tmp_path)
    (copy / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match=f"{copy}.*merges.txt"):
        load_tokenizer(copy)


def test_tokenizer_without_chatml_tokens_is_a_clear_error(folder: Path, tmp_path: Path):
    copy = _without_tokenizer_json(folder, tmp_path)
    _write_json(copy / "added_tokens.json", {})
    _write_json(copy / "tokenizer_config.json", {})
    with pytest.raises(TokenizerError, match=r"no <\|endoftext\|> token"):
        load_tokenizer(copy)


def test_save_then_load_is_the_same_tokenizer(folder: Path, tmp_path: Path):
    tok = load_tokenizer(_without_tokenizer_json(folder, tmp_path))
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.vocab_size == tok.vocab_size
    assert again.aliases == {"<|MASK|>": "<MASK>"}
    for text in TEXTS + ["<|MASK|>"]:
        assert again.encode(text) == tok.encode(text)


def test_train_tokenizer_round_trip(tmp_path: Path):
    tok = train_tokenizer(CORPUS * 3, 300, tmp_path / "trained")
    assert (tmp_path / "trained" / "tokenizer.json").is_file()
    assert (tmp_path / "trained" / "tokenizer_config.json").is_file()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.mask_token_id == 3 and tok.eos_token_ids == (2, 0)
    assert 4 + 256 < tok.vocab_size <= 300
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text.replace("e\u0301", "é")
    assert tok.encode("<|im_start|>user\n")[0] == 1


def test_train_tokenizer_is_deterministic(tmp_path: Path):
    train_tokenizer(iter(CORPUS), 300, tmp_path / "a")
    train_tokenizer(iter(CORPUS), 300, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_train_tokenizer_rejects_a_vocabulary_smaller_than_the_bytes(tmp_path: Path):
    with pytest.raises(TokenizerError, match="vocab_size=100 is too small"):
        train_tokenizer(CORPUS, 100, tmp_path / "tiny")
    smallest = len(SPECIAL_TOKENS) + 256          # the specials and the byte alphabet, no merge
    with pytest.raises(TokenizerError, match=f"vocab_size={smallest - 1} is too small"):
        train_tokenizer(CORPUS, smallest - 1, tmp_path / "tiny")
    assert train_tokenizer(CORPUS, smallest, tmp_path / "bytes").vocab_size == smallest


def test_invalid_added_tokens_json_is_a_clear_error(folder: Path):
    (folder / "added_tokens.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"added_tokens.json is not valid JSON"):
        load_tokenizer(folder)


GOLDEN_DIR = os.environ.get("DICE_TOKENIZER_DIR")


@pytest.mark.skipif(not GOLDEN_DIR, reason="set DICE_TOKENIZER_DIR to a folder with tokenizer_golden.json")
def test_golden_encodings_through_both_loading_paths(tmp_path: Path):
    folder = Path(GOLDEN_DIR)
    cases = json.loads((folder / "tokenizer_golden.json").read_text(encoding="utf-8"))["cases"]
    assert cases
    for tok in (load_tokenizer(folder), load_tokenizer(_without_tokenizer_json(folder, tmp_path))):
        for case in cases:
            ids = tok.encode(case["text"])
            assert ids == case["ids"], case["text"]
            assert tok.decode(ids) == case["decoded"], case["text"]
