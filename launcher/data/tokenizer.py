"""A local tokenizer for `action=prepare`: its file, hash, and the special tokens of a document.

`prepare.tokenizer` is a `tokenizer.json` or a Hugging Face folder holding one (and usually a
`tokenizer_config.json`, which names `eos_token`, `bos_token` and `add_bos_token`). Nothing is
downloaded. A document is encoded as its authors configured the tokenizer: the post-processor's
special tokens (what transformers' `tokenizer(text)` adds: Llama 3's `<|begin_of_text|>`), BOS
first when `add_bos_token` asks for it and the post-processor did not add it, then EOS unless the
post-processor ended the document with it. `prepare.eos_token` picks another end-of-document token
(an instruct tokenizer's config names its end-of-turn token, pretraining wants `<|endoftext|>`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

# Tried in order when no tokenizer_config.json names the EOS token (GPT-2/NeoX, Llama 3, Llama 2/Mistral, Gemma).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Any text does: the post-processor's special tokens are the positions outside the text's sequence.
_PROBE = "probe"


class TokenizerError(ValueError):
    """The tokenizer cannot be used (the message names the file and a fix)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What prepare records of a tokenizer (manifest.json "tokenizer") and applies to every document."""

    path: str  # the tokenizer.json read
    sha256: str  # of tokenizer.json: datasets with equal hashes share token ids
    vocab_size: int  # ids including added tokens
    eos_id: int  # the token that ends a document
    bos_id: Optional[int]  # the config's bos_token (None: none named, or not in the vocabulary)
    add_bos: bool  # the config's add_bos_token
    eos_token: str = ""
    # Every document is start_ids + the text's ids + end_ids: the post-processor's special tokens,
    # with prepend_ids (BOS by add_bos_token) before and append_ids (EOS) after, which prepare adds itself.
    start_ids: Tuple[int, ...] = ()
    end_ids: Tuple[int, ...] = ()
    prepend_ids: Tuple[int, ...] = ()
    append_ids: Tuple[int, ...] = ()
    starts_with: Tuple[str, ...] = ()  # start_ids as tokens (printed in prepare's summary)
    ends_with: Tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json of prepare.tokenizer (itself, or inside the folder)."""
    p = Path(path).expanduser()
    return p / "tokenizer.json" if p.is_dir() else p


def _token_text(value: object) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def open_for_documents(tok: Any) -> Any:
    """`tok` (a tokenizers.Tokenizer) set to encode whole documents: a tokenizer.json may carry a
    truncation or padding setting meant for inference, which would cut or pad documents silently."""
    tok.no_truncation()
    tok.no_padding()
    return tok


def post_processor_ids(tok: Any) -> Tuple[List[int], List[int]]:
    """The special-token ids the tokenizer's post-processor puts before and after a single text
    (what `encode(text, add_special_tokens=True)` and transformers' `tokenizer(text)` add)."""
    enc = tok.encode(_PROBE, add_special_tokens=True)
    inside = [i for i, s in enumerate(enc.sequence_ids) if s is not None]
    if not inside:
        return list(enc.ids), []
    return list(enc.ids[: inside[0]]), list(enc.ids[inside[-1] + 1:])


def _special_tokens(tok: Any, limit: int = 8) -> str:
    """A few of the vocabulary's special tokens, for a fix that must name one."""
    names = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") if names else "none"


def load_tokenizer_info(path: str, eos_token: str = "") -> TokenizerInfo:
    """Read and check prepare.tokenizer (and prepare.eos_token, "" for the config's); TokenizerError
    says what is wrong."""
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
        tok = open_for_documents(Tokenizer.from_str(raw.decode("utf-8")))
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
    if eos_token:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(f"prepare.eos_token={eos_token!r} is not a token of {file}. Fix: one of its special "
                                 f"tokens ({_special_tokens(tok)}), or leave prepare.eos_token empty for the "
                                 f"tokenizer_config.json's eos_token.")
    else:
        eos_text = _token_text(config.get("eos_token"))
        candidates = (eos_text,) if eos_text else EOS_NAMES
        eos_token = next((t for t in candidates if tok.token_to_id(t) is not None), "")
        if not eos_token:
            named = f"eos_token {eos_text!r} of {config_file}" if eos_text else f"any of {', '.join(EOS_NAMES)}"
            raise TokenizerError(f"prepare.tokenizer={path}: the vocabulary has no {named}, and every document needs "
                                 f"an end-of-document id. Fix: prepare.eos_token=TOKEN (one of {_special_tokens(tok)}), "
                                 f"or a tokenizer_config.json next to {file.name} whose eos_token is a token of the "
                                 f"vocabulary.")
        eos_id = tok.token_to_id(eos_token)
    add_bos = bool(config.get("add_bos_token", False))
    bos_text = _token_text(config.get("bos_token"))
    bos_id = tok.token_to_id(bos_text) if bos_text else None
    if add_bos and bos_id is None:
        raise TokenizerError(f"{config_file}: add_bos_token is true but bos_token {bos_text!r} is not in the "
                             f"vocabulary. Fix: set bos_token to a token of {file.name}, or add_bos_token: false.")
    before, after = post_processor_ids(tok)
    prepend = [bos_id] if add_bos and bos_id not in before else []
    append = [] if eos_id in after else [eos_id]
    start, end = prepend + before, after + append
    return TokenizerInfo(path=str(file.resolve()), sha256=hashlib.sha256(raw).hexdigest(),
                         vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_id=int(eos_id),
                         bos_id=None if bos_id is None else int(bos_id), add_bos=add_bos, eos_token=eos_token,
                         start_ids=tuple(start), end_ids=tuple(end), prepend_ids=tuple(prepend),
                         append_ids=tuple(append), starts_with=tuple(tok.id_to_token(i) for i in start),
                         ends_with=tuple(tok.id_to_token(i) for i in end))


def document_layout(start: Sequence[str], end: Sequence[str]) -> str:
    """How a document is written, for prepare's messages: "<|begin_of_text|> + text + <|end_of_text|>"."""
    return " + ".join([*start, "text", *end])
