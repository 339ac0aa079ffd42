"""A local tokenizer for `action=prepare`: its file, hash, special ids and BOS/EOS rule.

`prepare.tokenizer` is a `tokenizer.json` or a Hugging Face folder holding one (and usually a
`tokenizer_config.json`, which names `eos_token`, `bos_token` and `add_bos_token`). Nothing is
downloaded. Every document gets the EOS id appended, and the BOS id prepended when the config
says `add_bos_token: true`; the tokenizer's own post-processor is not applied (special tokens
come from this rule only, so a document's ids do not depend on the post-processor's template).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

# Tried in order when no tokenizer_config.json names the EOS token (GPT-2/NeoX, Llama 3, Llama 2/Mistral, Gemma).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class TokenizerError(ValueError):
    """The tokenizer cannot be used (the message names the file and a fix)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What prepare records of a tokenizer (manifest.json "tokenizer") and applies to every document."""

    path: str  # the tokenizer.json read
    sha256: str  # of tokenizer.json: datasets with equal hashes share token ids
    vocab_size: int  # ids including added tokens
    eos_id: int
    bos_id: Optional[int]  # None: no BOS is added
    add_bos: bool

    def to_json(self) -> dict:
        return asdict(self)


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json of prepare.tokenizer (itself, or inside the folder)."""
    p = Path(path).expanduser()
    return p / "tokenizer.json" if p.is_dir() else p


def _token_text(value: object) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def load_tokenizer_info(path: str) -> TokenizerInfo:
    """Read and check prepare.tokenizer; TokenizerError says what is wrong."""
    if not path:
        raise TokenizerError("prepare.tokenizer is empty. Fix: prepare.tokenizer=/path/to/tokenizer.json "
                             "or a Hugging Face folder holding tokenizer.json (nothing is downloaded).")
    file = tokenizer_file(path)
    if not file.is_file():
        raise TokenizerError(f"prepare.tokenizer={path}: {file} does not exist. Fix: give a local tokenizer.json or "
                             f"a Hugging Face folder holding one (the launcher never downloads tokenizers).")
    from tokenizers import Tokenizer  # lazy: tokenizers (a Rust extension) only when a tokenizer.json is read

    raw = file.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # the library raises bare Exception for a malformed file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TokenizerError(f"prepare.tokenizer={path}: {file} is not a tokenizer.json ({first}). "
                             f"Fix: give a Hugging Face tokenizer.json.") from None
    config = {}
    config_file = file.with_name("tokenizer_config.json")
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise TokenizerError(f"{config_file}: not JSON ({err}). Fix: repair or remove it.") from None
    eos_text = _token_text(config.get("eos_token"))
    candidates = (eos_text,) if eos_text else EOS_NAMES
    eos_id = next((tok.token_to_id(t) for t in candidates if tok.token_to_id(t) is not None), None)
    if eos_id is None:
        named = f"eos_token {eos_text!r} of {config_file}" if eos_text else f"any of {', '.join(EOS_NAMES)}"
        raise TokenizerError(f"prepare.tokenizer={path}: the vocabulary has no {named}, and every document needs "
                             f"an end-of-document id. Fix: a tokenizer_config.json next to {file.name} whose eos_token "
                             f"is a token of the vocabulary.")
    add_bos = bool(config.get("add_bos_token", False))
    bos_id = None
    if add_bos:
        bos_text = _token_text(config.get("bos_token"))
        bos_id = tok.token_to_id(bos_text) if bos_text else None
        if bos_id is None:
            raise TokenizerError(f"{config_file}: add_bos_token is true but bos_token {bos_text!r} is not in the "
                                 f"vocabulary. Fix: set bos_token to a token of {file.name}, or add_bos_token: false.")
    return TokenizerInfo(path=str(file.resolve()), sha256=hashlib.sha256(raw).hexdigest(),
                         vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_id=int(eos_id),
                         bos_id=None if bos_id is None else int(bos_id), add_bos=add_bos)
