"""Tokenizers behind one small protocol: a Hugging Face `tokenizer.json`, a sentencepiece model,
or a tiktoken BPE file with special tokens (Kimi K2 / Moonlight layout).

`encode` treats its input as ordinary text: special-token strings in it ("<|im_end|>" written
by a program's output) are tokenized as text, never turned into control tokens, so a tool
observation cannot forge a turn boundary. Chat formats insert control tokens by id. Added tokens
that are not special (Qwen's `<tool_call>`, sentencepiece user-defined symbols) are still matched
in text, as the original tokenizers do.

`encode_special` is for text a chat template wrote: there special-token strings become their
control tokens, as Hugging Face encodes `apply_chat_template`'s output. `envs.chat.jinja_format`
uses it on the template's own text only, never on message text.

The backends are imported lazily: a rollout worker loads only the one it uses.
"""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Any, Optional, Protocol, Sequence


class Tokenizer(Protocol):
  """What Arbor needs from a tokenizer."""

  vocab_size: int          # every id is in [0, vocab_size)
  bos_id: Optional[int]    # beginning of sequence, if the tokenizer has one
  eos_id: int              # end of sequence
  pad_id: Optional[int]
  special_ids: frozenset   # control tokens (never produced by `encode`)

  def encode(self, text: str) -> list[int]:
    """Ids of ordinary text (no BOS/EOS added; special-token strings are plain text)."""

  def encode_special(self, text: str) -> list[int]:
    """Ids of template text: special-token strings in it become their control tokens."""

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ids; control tokens appear as their strings."""

  def token_to_id(self, token: str) -> Optional[int]:
    """The id of one whole token (special or not), or None if `token` is not a single token."""


def _name(value: Any) -> Optional[str]:
  """A token name from tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def _read_config(directory: str) -> dict:
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _special_splitter(names) -> Optional[re.Pattern]:
  """A regex that splits text at special-token strings (longest first), or None if none."""
  names = sorted((n for n in names if n), key=len, reverse=True)
  return re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None


def _encode_split(text: str, splitter, special: dict, encode) -> list[int]:
  """Encodes text with special-token strings as their ids and the rest with `encode`."""
  if splitter is None:
    return encode(text)
  out: list[int] = []
  for i, part in enumerate(splitter.split(text)):
    out += [special[part]] if i % 2 else (encode(part) if part else [])
  return out


def _require_id(tok: Tokenizer, what: str, token: Optional[str], source: str) -> Optional[int]:
  if token is None:
    return None
  i = tok.token_to_id(token)
  if i is None:
    raise ValueError(f"{what}={token!r} is not a token of {source}")
  return i


class HFTokenizer:
  """A `tokenizers.Tokenizer` (what `tokenizer.json` holds). Never adds BOS/EOS by itself.

  Args:
    tok: the `tokenizers.Tokenizer`.
    eos_token: name of the end-of-sequence token.
    bos_token: name of the beginning-of-sequence token; None: the tokenizer has none.
    pad_token: name of the padding token; None: none.
    source: where the tokenizer came from, for error messages.

  Raises:
    ValueError: a named token is not a token of the vocabulary.
  """

  def __init__(self, tok, *, eos_token: str, bos_token: Optional[str] = None,
               pad_token: Optional[str] = None, source: str = "tokenizer.json"):
    self._tok = tok
    self._tok_special = None  # built on first encode_special
    # Why: with this flag the library tokenizes special added tokens as text (see module doc);
    # non-special added tokens are still matched, as in the original tokenizer.
    self._tok.encode_special_tokens = True
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    self.eos_id = _require_id(self, "eos_token", eos_token, source)
    self.bos_id = _require_id(self, "bos_token", bos_token, source)
    self.pad_id = _require_id(self, "pad_token", pad_token, source)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_special(self, text: str) -> list[int]:
    if self._tok_special is None:
      import tokenizers

      # A copy that matches special tokens in text, as transformers' fast tokenizers do.
      self._tok_special = tokenizers.Tokenizer.from_str(self._tok.to_str())
      self._tok_special.encode_special_tokens = False
    return self._tok_special.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=False)

  def token_to_id(self, token: str) -> Optional[int]:
    i = self._tok.token_to_id(token)
    if i is not None:
      return i
    # A plain-text token of a byte-level vocabulary is stored in its byte-to-unicode spelling.
    ids = self._tok.encode(token, add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 and self.decode(ids) == token else None


def load_hf_tokenizer(path: str, *, eos_token: Optional[str] = None,
                      bos_token: Optional[str] = None,
                      pad_token: Optional[str] = None) -> HFTokenizer:
  """Loads a Hugging Face `tokenizer.json`.

  Args:
    path: the file, or a directory holding it and maybe tokenizer_config.json.
    eos_token: EOS token name; None: tokenizer_config.json's.
    bos_token: BOS token name; None: tokenizer_config.json's (or no BOS).
    pad_token: PAD token name; None: tokenizer_config.json's (or no PAD).

  Returns:
    The tokenizer.

  Raises:
    ValueError: no EOS name is given or configured, or a named token is not in the vocabulary.
  """
  import tokenizers

  directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (
      os.path.dirname(path), path)
  config = _read_config(directory)
  eos_token = eos_token or _name(config.get("eos_token"))
  if eos_token is None:
    raise ValueError(f"eos_token: not given and {directory}/tokenizer_config.json names none")
  return HFTokenizer(tokenizers.Tokenizer.from_file(file), eos_token=eos_token,
                     bos_token=bos_token or _name(config.get("bos_token")),
                     pad_token=pad_token or _name(config.get("pad_token")), source=file)


class SentencePieceTokenizer:
  """A sentencepiece model. Control symbols are never produced from text.

  Chat formats encode text between control tokens piece by piece, so a model trained with
  `add_dummy_prefix=true` gets a "▁" at the start of every piece; train new models with
  `add_dummy_prefix=false`, `normalization_rule_name=identity`, `remove_extra_whitespaces=false`
  and `byte_fallback=true` so that code (newlines, indentation) survives exactly.

  Args:
    model_file: path of the `.model` file.
    model_proto: the serialized model, instead of `model_file`.

  Raises:
    ValueError: not exactly one of model_file, model_proto is given, or the model has no EOS.
  """

  def __init__(self, model_file: Optional[str] = None, *, model_proto: Optional[bytes] = None):
    import sentencepiece

    if (model_file is None) == (model_proto is None):
      raise ValueError("SentencePieceTokenizer: give exactly one of model_file, model_proto")
    self._sp = (sentencepiece.SentencePieceProcessor(model_file=model_file) if model_file
                else sentencepiece.SentencePieceProcessor(model_proto=model_proto))
    sp = self._sp
    self.vocab_size = sp.get_piece_size()
    opt = lambda i: None if i < 0 else i  # sentencepiece says -1 for "none"
    self.bos_id, self.pad_id, eos = opt(sp.bos_id()), opt(sp.pad_id()), opt(sp.eos_id())
    if eos is None:
      raise ValueError(f"sentencepiece model {model_file or '<proto>'} has no eos piece")
    self.eos_id = eos
    self.special_ids = frozenset(i for i in range(self.vocab_size) if sp.is_control(i))
    self._special = {sp.id_to_piece(i): i for i in self.special_ids}
    self._splitter = _special_splitter(self._special)

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_special(self, text: str) -> list[int]:
    # sentencepiece never reads control symbols from text: cut the text at them.
    return _encode_split(text, self._splitter, self._special, self.encode)

  def decode(self, ids: Sequence[int]) -> str:
    # sentencepiece decodes control tokens to "": split at them to show their names.
    out, run = [], []
    for i in ids:
      if i in self.special_ids:
        out += [self._sp.decode(run), self._sp.id_to_piece(i)]
        run = []
      else:
        run.append(i)
    return "".join(out) + self._sp.decode(run)

  def token_to_id(self, token: str) -> Optional[int]:
    i = self._sp.piece_to_id(token)
    return i if self._sp.id_to_piece(i) == token else None


# Kimi K2 / Moonlight pre-tokenizer regex (tiktoken syntax: `&&` is class intersection).
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# tiktoken's regex is very slow on huge runs of whitespace or of non-whitespace
# (openai/tiktoken#195): such runs are cut into pieces of at most this many characters.
_MAX_RUN = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (_MAX_RUN + 1, _MAX_RUN + 1))


class TiktokenTokenizer:
  """A `tiktoken.Encoding` plus the names of its BOS/EOS/PAD tokens.

  Args:
    encoding: the `tiktoken.Encoding`.
    eos_token: name of the end-of-sequence token.
    bos_token: name of the beginning-of-sequence token; None: the tokenizer has none.
    pad_token: name of the padding token; None: none.
    source: where the encoding came from, for error messages.

  Raises:
    ValueError: a named token is not a token of the encoding.
  """

  def __init__(self, encoding, *, eos_token: str, bos_token: Optional[str] = None,
               pad_token: Optional[str] = None, source: str = "tiktoken"):
    self._enc = encoding
    self.vocab_size = encoding.n_vocab
    self._special = dict(encoding._special_tokens)  # name -> id
    self.special_ids = frozenset(self._special.values())
    self._splitter = _special_splitter(self._special)
    self.eos_id = _require_id(self, "eos_token", eos_token, source)
    self.bos_id = _require_id(self, "bos_token", bos_token, source)
    self.pad_id = _require_id(self, "pad_token", pad_token, source)

  def encode_special(self, text: str) -> list[int]:
    # As tiktoken's encode(allowed_special="all"): ordinary text between special tokens.
    return _encode_split(text, self._splitter, self._special, self.encode)

  def encode(self, text: str) -> list[int]:
    out, start = [], 0
    for m in _LONG_RUN.finditer(text):
      out += self._enc.encode_ordinary(text[start:m.start()])
      for i in range(m.start(), m.end(), _MAX_RUN):
        out += self._enc.encode_ordinary(text[i:min(i + _MAX_RUN, m.end())])
      start = m.end()
    return out + self._enc.encode_ordinary(text[start:])

  def decode(self, ids: Sequence[int]) -> str:
    return self._enc.decode(list(ids))

  def token_to_id(self, token: str) -> Optional[int]:
    if token in self._special:
      return self._special[token]
    try:
      return self._enc.encode_single_token(token.encode("utf-8"))
    except KeyError:
      return None


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """Reads a tiktoken BPE file: one `base64(token) rank` per line (blank lines skipped).

  Raises:
    ValueError: a line is not `base64-token rank`; the message names the file and line.
  """
  ranks = {}
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
      except ValueError as e:
        raise ValueError(f"{path}:{n}: expected 'base64-token rank', got {line[:80]!r}") from e
  return ranks


def load_tiktoken(path: str, *, special_tokens: Optional[dict[str, int]] = None,
                  pat_str: str = KIMI_PATTERN, num_reserved_special_tokens: int = 256,
                  eos_token: Optional[str] = None, bos_token: Optional[str] = None,
                  pad_token: Optional[str] = None) -> TiktokenTokenizer:
  """Loads a tiktoken BPE (`tiktoken.model`).

  Args:
    path: the file, or a directory holding it and maybe tokenizer_config.json.
    special_tokens: name -> id of the special tokens. None: Kimi's layout, ids
      [n_base, n_base + reserved + 2) named by tokenizer_config.json's `added_tokens_decoder`,
      the rest `<|reserved_token_{id}|>`.
    pat_str: the pre-tokenizer regex (tiktoken syntax); default Kimi K2's.
    num_reserved_special_tokens: the "reserved" of Kimi's layout (used when special_tokens is
      None).
    eos_token: EOS token name; None: tokenizer_config.json's, then "[EOS]" (Kimi's).
    bos_token: BOS token name; None: tokenizer_config.json's, then "[BOS]" if it exists.
    pad_token: PAD token name; None: tokenizer_config.json's (or no PAD).

  Returns:
    The tokenizer.

  Raises:
    ValueError: a malformed BPE file, or a named token is not in the encoding.
  """
  import tiktoken

  directory, file = (path, os.path.join(path, "tiktoken.model")) if os.path.isdir(path) else (
      os.path.dirname(path), path)
  config = _read_config(directory)
  ranks = read_tiktoken_ranks(file)
  if special_tokens is None:
    names = {int(i): _name(t) for i, t in config.get("added_tokens_decoder", {}).items()}
    n = len(ranks)
    special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                      for i in range(n, n + num_reserved_special_tokens + 2)}
  encoding = tiktoken.Encoding(name=os.path.basename(file), pat_str=pat_str,
                               mergeable_ranks=ranks, special_tokens=special_tokens)
  return TiktokenTokenizer(
      encoding, eos_token=eos_token or _name(config.get("eos_token")) or "[EOS]",
      bos_token=bos_token or _name(config.get("bos_token")) or (
          "[BOS]" if "[BOS]" in special_tokens else None),
      pad_token=pad_token or _name(config.get("pad_token")), source=file)


def load_tokenizer(path: str, **kw) -> Tokenizer:
  """Loads a tokenizer with the loader that fits what `path` holds.

  Args:
    path: tokenizer.json, tiktoken.model, or a sentencepiece model (`*.model`), or a directory
      holding one of them (sentencepiece as tokenizer.model).
    **kw: keyword arguments of the chosen loader.

  Returns:
    The tokenizer.

  Raises:
    ValueError: a directory holds none of the three files, or the loader rejects the file.
  """
  if os.path.isdir(path):
    for name, loader in (("tokenizer.json", load_hf_tokenizer), ("tiktoken.model", load_tiktoken)):
      if os.path.exists(os.path.join(path, name)):
        return loader(path, **kw)
    if os.path.exists(os.path.join(path, "tokenizer.model")):
      return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"), **kw)
    raise ValueError(f"path={path!r}: no tokenizer.json, tiktoken.model or tokenizer.model in it")
  if path.endswith(".json"):
    return load_hf_tokenizer(path, **kw)
  with open(path, "rb") as f:
    head = f.readline(200)
  # A tiktoken file is text lines "base64 rank"; a sentencepiece model is a binary protobuf.
  if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", head):
    return load_tiktoken(path, **kw)
  return SentencePieceTokenizer(path, **kw)
