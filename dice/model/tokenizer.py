"""Byte-level BPE tokenizer of the SDAR / DICE checkpoints, and of small from-scratch models.

DESIGN.md §3. The SDAR tokenizer is Qwen2's: NFC normalisation, a regex split into words,
numbers (one digit per piece), punctuation runs and whitespace runs, then every byte mapped to
a printable character (GPT-2's byte-level alphabet) and merged by BPE. Added tokens
(`<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645, ..., mask 151669) are
matched in the raw text before any of that, so their spellings in a prompt become their ids.

A folder is read from `tokenizer.json` when it has one, else the same tokenizer is built from
`vocab.json` + `merges.txt` + the added tokens of `added_tokens.json` and the
`added_tokens_decoder` of `tokenizer_config.json`. One id can have two spellings there: SDAR's
mask is `<MASK>` in added_tokens.json and `<|MASK|>` in tokenizer_config.json. The `tokenizers`
library keeps one spelling per id, so the other is kept here as an alias that `encode` and
`token_to_id` accept too. The folder's chat template (`chat_template.jinja`, or the
`chat_template` of tokenizer_config.json) is kept as text: `dice.tasks.prompts.thinks` reads from it
whether the model answers after a think block (SDAR/DICE: Qwen3's template).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import UserError, json_problem

# Qwen2's split, the same string as in the `pre_tokenizer` of Qwen2 / SDAR tokenizer.json files.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|MASK|>"
MASK_SPELLINGS = (MASK, "<MASK>")
# Special tokens of a tokenizer trained by train_tokenizer, which get ids 0..3 in this order.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)


class TokenizerError(UserError):
    """A tokenizer folder that cannot be used; the message names the folder and the fix."""


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the token ids DICE needs.

    `encode` inserts no tokens of its own (no BOS/EOS) and turns special-token spellings in
    the text into their ids; `decode` keeps special tokens, so `decode(encode(x)) == x`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        aliases: dict[str, str] | None = None,
        mask_token_id: int | None = None,
        source: str = "tokenizer",
        chat_template: str = "",
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.aliases = dict(aliases or {})  # second spelling -> the backend's spelling of that id
        self.source = source  # where it came from, for error messages
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.pad_token_id = self._require(ENDOFTEXT)
        self.im_start_id = self._require(IM_START)
        self.im_end_id = self._require(IM_END)
        # Chat turns end with <|im_end|>; pretraining-style text ends with <|endoftext|>.
        self.eos_token_ids = (self.im_end_id, self.pad_token_id)
        if mask_token_id is None:
            mask_token_id = next(
                (i for i in map(self.token_to_id, MASK_SPELLINGS) if i is not None), None
            )
        self._mask_token_id = mask_token_id

    def _require(self, token: str) -> int:
        token_id = self.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{self.source}: the tokenizer has no {token} token; DICE needs the ChatML "
                f"tokens {ENDOFTEXT}, {IM_START}, {IM_END}: use a Qwen2/SDAR tokenizer or train_tokenizer"
            )
        return token_id

    @property
    def mask_token_id(self) -> int:
        if self._mask_token_id is None:
            raise TokenizerError(
                f"{self.source}: no mask token; add \"mask_token_id\" to the model's config.json "
                f"or a {MASK} added token to the tokenizer"
            )
        return self._mask_token_id

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(self.aliases.get(token, token))

    def encode(self, text: str) -> list[int]:
        for alias, spelling in self.aliases.items():
            text = text.replace(alias, spelling)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # int() accepts numpy / torch integers, which the Rust side does not.
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, out_dir: str | os.PathLike) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` and `added_tokens.json` into `out_dir`.

        tokenizer.json alone is the whole tokenizer; tokenizer_config.json lists the added
        tokens the way Hugging Face folders do; added_tokens.json also keeps the aliases.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        added = sorted(self.backend.get_added_tokens_decoder().items())
        decoder = {
            str(i): {
                "content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special,
            }
            for i, t in added
        }
        _write_json(out / "tokenizer_config.json", {"added_tokens_decoder": decoder})
        spellings = {t.content: i for i, t in added}
        spellings.update({alias: spellings[name] for alias, name in self.aliases.items()})
        _write_json(out / "added_tokens.json", spellings)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a model or tokenizer folder (see the module docstring for the files).

    The mask id is the folder's config.json `mask_token_id` when present (SDAR: 151669), else
    the id of `<|MASK|>` or `<MASK>`.
    """
    folder = Path(path)
    declared = _declared_added_tokens(folder)
    if (folder / "tokenizer.json").is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:   # the Rust side raises a bare Exception ("EOF while parsing ...")
            raise TokenizerError(f"{folder / 'tokenizer.json'} cannot be read ({e}); it is truncated or "
                                 "corrupt: copy or download it again") from None
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        backend = _from_vocab_and_merges(folder, declared)
    else:
        what = "folder does not exist" if not folder.is_dir() else "folder has no tokenizer files"
        raise TokenizerError(
            f"{folder}: {what}; expected tokenizer.json, or vocab.json + merges.txt "
            f"(+ added_tokens.json): point the path at a model or tokenizer folder that has them"
        )
    added = backend.get_added_tokens_decoder()
    aliases = {
        name: added[i].content for name, i in declared if i in added and added[i].content != name
    }
    mask_token_id = _read_json(folder / "config.json").get("mask_token_id")
    return Tokenizer(backend, aliases=aliases, mask_token_id=mask_token_id, source=str(folder),
                     chat_template=_chat_template(folder))


def _chat_template(folder: Path) -> str:
    """The folder's chat template as text ("" when it has none)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "tokenizer_config.json").get("chat_template", "")
    # Hugging Face also allows a list of named templates
    return template if isinstance(template, str) else "\n".join(t.get("template", "") for t in template)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` ids on `texts` and save it into `out_dir`.

    Same normaliser, split and byte alphabet as the SDAR tokenizer, with ids 0..3 for
    `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|MASK|>`, then the 256 bytes, then the
    merges (fewer when the corpus runs out of pairs). The same texts give the same tokenizer.
    """
    smallest = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < smallest:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs {smallest} ids for its "
            f"special tokens and 256 bytes; pass a larger vocab_size"
        )
    backend = _byte_level_bpe(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        # Every byte gets a token, so any text can be encoded without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    Tokenizer(backend, source=str(out_dir)).save(out_dir)
    return load_tokenizer(out_dir)


def _byte_level_bpe(model: models.BPE) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        # The split above replaces ByteLevel's own GPT-2 regex.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _from_vocab_and_merges(folder: Path, declared: list[tuple[str, int]]) -> tokenizers.Tokenizer:
    vocab, merges = models.BPE.read_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    spelling_of_id: dict[int, str] = {}
    for name, i in declared:
        spelling_of_id.setdefault(i, name)
    # `tokenizers` gives an added token the id its model vocabulary has for it (else the next
    # free id), so putting the added tokens into the vocabulary pins their declared ids.
    vocab.update({name: i for i, name in spelling_of_id.items()})
    backend = _byte_level_bpe(models.BPE(vocab, merges))
    backend.add_special_tokens(
        [AddedToken(spelling_of_id[i], special=True, normalized=False) for i in sorted(spelling_of_id)]
    )
    return backend


def _declared_added_tokens(folder: Path) -> list[tuple[str, int]]:
    """(spelling, id) of the added tokens the folder's JSON files declare, added_tokens.json first.

    The first spelling of an id is its main one, as in the tokenizer.json built from SDAR's
    files (mask `<MASK>`, the spelling the golden encodings use).
    """
    declared = [(name, int(i)) for name, i in _read_json(folder / "added_tokens.json").items()]
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    declared += [(token["content"], int(i)) for i, token in decoder.items()]
    return declared


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{file} is not valid JSON ({json_problem(e)}); re-download or fix it") from None


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
