"""Train a small sentencepiece tokenizer from local text (`python -m trainer.data train_tokenizer`).

    python -m trainer.data train_tokenizer --input a.txt b.py --vocab_size 2048 --out DIR
    python -m trainer.data train_tokenizer --demo_corpus --vocab_size 1024 --out DIR

writes DIR/tokenizer.model (`envs.chat.load_tokenizer(DIR)` loads it) and
DIR/tokenizer_info.json (the options used, for the record). `hf_tokenizer` converts such a model
to a Hugging Face `tokenizers` tokenizer with the same ids (what `python -m trainer.export`
writes as tokenizer.json, so `AutoTokenizer` loads an exported run).

The model is made for `envs.chat`: chat formats encode the text between control tokens piece by
piece and concatenate the ids, so text must round-trip exactly and encode the same wherever it
is cut. Hence: byte fallback (no unknown characters), identity normalisation, no dummy prefix,
whitespace kept as is, and pieces may span whitespace (indentation, "\\n    return").

The chat format's tokens become single ids: turn markers (ChatML's <|im_start|>/<|im_end|>,
DeepSeek-V3's <｜...｜> tokens) as *control* symbols, which encoding never produces from text
(a tool output cannot forge a turn boundary), and tool-call markers (<tool_call>, ...) as
*user-defined* symbols, which are matched in text as Qwen's tokenizer does. Ids: <unk> 0,
BOS 1, EOS 2, <pad> 3, then the control and user-defined symbols in order. BOS/EOS are <s> and
</s>, or the format's own (DeepSeek-V3's <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>).
"""

from __future__ import annotations

import io
import json
import os
from typing import Iterable, Sequence

from envs.chat.formats import FORMATS, DeepSeekV3

# chat format -> (control symbols, user-defined symbols)
_HERMES = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHAT_SYMBOLS = {
    "chatml": (("<|im_start|>", "<|im_end|>"), _HERMES),
    "qwen2.5": (("<|im_start|>", "<|im_end|>"), _HERMES),
    "deepseek_v3": (tuple(v for k, v in DeepSeekV3.TOKENS.items() if k not in ("bos", "eos")),
                    ()),
    "plain": ((), _HERMES[:2]),
}
# chat format -> (BOS, EOS) piece names, where the format names them (default <s>, </s>)
BOS_EOS = {"deepseek_v3": (DeepSeekV3.TOKENS["bos"], DeepSeekV3.TOKENS["eos"])}
MAX_CHUNK = 2000  # characters per training "sentence" (sentencepiece skips very long ones)


def chat_symbols(chat_format: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The (control, user-defined) symbols `chat_format` needs as single tokens.

  Raises:
    ValueError: an unknown chat format.
  """
  if chat_format not in CHAT_SYMBOLS:
    raise ValueError(f"chat_format={chat_format!r}: expected one of {', '.join(FORMATS)}")
  return CHAT_SYMBOLS[chat_format]


def chunks(text: str, size: int = MAX_CHUNK) -> list[str]:
  """Cuts `text` at line ends into training sentences.

  Newlines stay inside the pieces, so pieces may learn "\\n" + indentation.

  Args:
    text: the text.
    size: the most characters per piece (a longer line is cut anywhere).

  Returns:
    The pieces, in order; their concatenation is `text`.
  """
  out, cur = [], ""
  for line in text.splitlines(keepends=True):
    while len(line) > size:
      out += [cur] if cur else []
      out.append(line[:size])
      cur, line = "", line[size:]
    if len(cur) + len(line) > size:
      out.append(cur)
      cur = ""
    cur += line
  return out + ([cur] if cur else [])


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str, *,
                    chat_format: str = "chatml", special_tokens: Sequence[str] = (),
                    user_symbols: Sequence[str] = (), model_type: str = "bpe",
                    split_digits: bool = True) -> str:
  """Trains a sentencepiece model on `texts` and writes out_dir/tokenizer.model.

  Also writes out_dir/tokenizer_info.json (the options used).

  Args:
    texts: the training text; each is cut with `chunks`.
    vocab_size: the vocabulary size, larger than the reserved and special pieces.
    out_dir: the output directory (created).
    chat_format: the envs.chat format whose symbols become single tokens (`chat_symbols`).
    special_tokens: extra control symbols beyond the chat format's.
    user_symbols: extra user-defined symbols beyond the chat format's.
    model_type: the sentencepiece model type ("bpe", "unigram", ...).
    split_digits: split numbers into single digits.

  Returns:
    The path of tokenizer.model.

  Raises:
    ValueError: no text, or a vocab_size too small for the reserved pieces or too large for
      the text.
  """
  import sentencepiece as spm

  control, user = chat_symbols(chat_format)
  bos, eos = BOS_EOS.get(chat_format, ("<s>", "</s>"))
  control = list(dict.fromkeys(list(control) + list(special_tokens)))
  user = [s for s in dict.fromkeys(list(user) + list(user_symbols)) if s not in control]
  sentences = [c for t in texts for c in chunks(t) if c]
  if not sentences:
    raise ValueError("train_tokenizer: no text to train on (empty inputs)")
  if not isinstance(vocab_size, int) or vocab_size < 4 + len(control) + len(user) + 1:
    raise ValueError(f"vocab_size={vocab_size!r}: expected an integer larger than the "
                     f"{4 + len(control) + len(user)} reserved and special pieces")
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, split_by_whitespace=False, allow_whitespace_only_pieces=True,
        split_digits=split_digits, max_sentence_length=4 * MAX_CHUNK + 16,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, bos_piece=bos, eos_piece=eos,
        control_symbols=control,
        user_defined_symbols=user, num_threads=1, minloglevel=2)
  except RuntimeError as e:
    if "Vocabulary size" in str(e):
      raise ValueError(f"vocab_size={vocab_size}: too large for this text ({e})") from None
    raise
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "tokenizer.model")
  with open(path + ".tmp", "wb") as f:
    f.write(model.getvalue())
  os.replace(path + ".tmp", path)
  with open(os.path.join(out_dir, "tokenizer_info.json"), "w") as f:
    json.dump({"vocab_size": vocab_size, "chat_format": chat_format, "control_symbols": control,
               "user_defined_symbols": user, "model_type": model_type,
               "split_digits": split_digits, "sentences": len(sentences)}, f, indent=1)
  return path


# sentencepiece piece types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6


def hf_tokenizer(model_path: str):
  """A sentencepiece BPE model trained by `train_tokenizer` as a Hugging Face tokenizer.

  Same ids for every text: the vocabulary is the model's pieces in order, and the merges are
  every split (a, b) of a normal piece into two pieces of the vocabulary, ranked by the merged
  piece's score, best first; sentencepiece's BPE merges the adjacent pair whose union scores
  best, so both merge in the same order. Spaces become "▁" (no dummy prefix: the model has
  none), unknown characters fall back to byte pieces, user-defined symbols are added tokens
  matched in text, control symbols special added tokens.

  Args:
    model_path: a tokenizer.model written by `train_tokenizer`.

  Returns:
    The `tokenizers.Tokenizer`.

  Raises:
    ValueError: the model is not a BPE model with byte fallback and without a dummy prefix or
      normalisation (not one `train_tokenizer` made).
  """
  import tokenizers
  from sentencepiece import sentencepiece_model_pb2
  from tokenizers import AddedToken, decoders, models, normalizers

  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_path, "rb") as f:
    proto.ParseFromString(f.read())
  spec, norm = proto.trainer_spec, proto.normalizer_spec
  if not (spec.model_type == spec.BPE and spec.byte_fallback and not norm.add_dummy_prefix
          and norm.name == "identity" and not norm.remove_extra_whitespaces):
    raise ValueError(f"{model_path}: not a sentencepiece BPE model with byte fallback, identity "
                     "normalisation and no dummy prefix (train_tokenizer's settings)")
  pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
  vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
  merges = []
  for i, (piece, score, kind) in enumerate(pieces):
    if kind != _NORMAL:
      continue
    for k in range(1, len(piece)):
      a, b = vocab.get(piece[:k]), vocab.get(piece[k:])
      if a is not None and b is not None and pieces[a][2] == pieces[b][2] == _NORMAL:
        merges.append((-score, i, a, (piece[:k], piece[k:])))
  merges.sort()
  unk = next(piece for piece, _, kind in pieces if kind == _UNKNOWN)
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[m[-1] for m in merges],
                                        unk_token=unk, byte_fallback=True, fuse_unk=True))
  tok.normalizer = normalizers.Replace(" ", "▁")
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.add_tokens([AddedToken(piece, special=False, normalized=False)
                  for piece, _, kind in pieces if kind == _USER_DEFINED])
  tok.add_special_tokens([AddedToken(piece, special=True, normalized=False)
                          for piece, _, kind in pieces if kind in (_UNKNOWN, _CONTROL)])
  return tok


def read_texts(paths: Sequence[str]) -> list[str]:
  """The contents of text files (UTF-8; undecodable bytes replaced).

  Raises:
    ValueError: a path that is not a file.
  """
  out = []
  for p in paths:
    if not os.path.isfile(p):
      raise ValueError(f"--input {p!r}: no such file")
    with open(p, encoding="utf-8", errors="replace") as f:
      out.append(f.read())
  return out
