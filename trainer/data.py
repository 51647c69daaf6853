"""SFT data: chat records and recorded trajectories -> trajectory trees -> fixed-shape packed
micro-batches, as a checkpointable grain pipeline.

    chat = make_chat("chatml", load_tokenizer("tok_dir"))
    ds = make_sft_dataset(SFTDataConfig(sources=("train.jsonl",), row_len=1024), chat)
    it = iter(ds)
    step = next(it)             # {"batch": MicroBatches, "stats": {...}}, see below
    state = it.get_state()      # JSON-able; iter(ds).set_state(state) resumes exactly here

Inputs: `SFTDataConfig.sources` (*.jsonl, *.parquet, *.msgpack) and/or `records=` in memory:
chat records {"messages", "tools"?, "group"?, "branches"?} and recorded trajectories
(`envs.trajectory.Trajectory`). `trainer.sft_data` defines the records, how a conversation
becomes one trajectory (one LLM call per assistant turn, trained tokens = assistant tokens) and
error-masked SFT (a turn whose tool call failed stays in context, out of the loss).

Trees. Records are grouped into trees (`group_by`): "field" (default) puts records with the same
"group" (chat) / "group_id" (trajectory) into one tree; "prompt" groups records with the same
tools and messages before the first assistant turn (trajectories: the same first-call input);
"system" groups chat records with the same tools and leading system messages (the agent prompt
that every record repeats); "none" makes every record its own tree (a record's "branches" still
share one). Groups are cut into chunks of at most `max_group_size` records. In a tree, identical
token prefixes are stored once; every trajectory still trains all of its own assistant tokens,
so a tree trains exactly what the conversations would train one by one (docs/design.md §3).

Pipeline (grain): groups (read lazily from the files) -> shuffle by seed (reshuffled each
epoch) -> repeat `num_epochs` (None: forever) -> render + build_tree (`num_threads` threads) ->
greedy packing: trees are added to a micro-batch while `rl.packing.pack` fits them in
`rows_per_batch` rows of `row_len` with at most `max_seqs` trajectories of at most `seq_len`
trained tokens, and `microbatches` micro-batches make one step. Iterator state: the upstream
index before the first tree not yet emitted, and counters; resuming re-reads that tree.

Each step is {"batch": trainer.batches.MicroBatches, "stats": dict}: the arrays the train step
consumes, M = microbatches micro-batches of R = rows_per_batch rows of L = row_len tokens and
S = max_seqs sequences of T = seq_len trained tokens (padding micro-batches at the end of the
data are all padding, which the step skips). Fields: "loss_mask", "failed", "turn". seq_id and
scalars["group"] number the step's trajectories and trees in order (-1 for padding).
stats (ints, for logging): trajectories, trees, row_tokens (row positions holding a token),
loss_tokens, linear_tokens (Σ over calls of input + output: what training every call unpacked
would process; linear_tokens / row_tokens is the tree gain), skipped (cumulative).

Bad records. A malformed record raises `RecordError` naming where it is (file:line, Parquet row,
records[i]) and the field. With `skip_bad` it is logged and counted instead: structural errors
when the files are scanned (`dataset.load_errors`), rendering errors and trees that cannot fit a
micro-batch when they are reached (`stats["skipped"]`, part of the iterator state).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
from typing import Any, Optional, Sequence

import grain
import jax
import numpy as np

from envs.chat import load_tokenizer, make_chat
from envs.chat.formats import ChatFormat
from rl.packing import TreeBatch, pack
from rl.tree import Tree, TrajectoryTokens, build_tree
from trainer.batches import BatchShape, MicroBatches, make_micro_batches
from trainer.demo_data import chat_record, demo_corpus, demo_trajectories
from trainer.sft_data import (GROUP_BY, MemoryReader, Reader, RecordError, check_record,
                              conversation_calls, failed_turns, group_key, reader_for,
                              record_trajectories, write_jsonl)
from trainer.tokenizer_train import read_texts, train_tokenizer

log = logging.getLogger(__name__)

__all__ = ["SFTDataConfig", "SFTDataset", "make_sft_dataset", "RecordError", "check_record",
           "conversation_calls", "failed_turns", "record_trajectories",
           "write_jsonl", "main"]
STATS = ("trajectories", "trees", "row_tokens", "loss_tokens", "linear_tokens", "skipped")


@dataclasses.dataclass(frozen=True)
class SFTDataConfig:
  """What to read and how to batch it (validated at construction).

  Raises:
    ValueError: a bad field; the message names it, its value and what is expected.
  """

  sources: tuple[str, ...] = ()     # *.jsonl / *.parquet / *.msgpack files (or records=)
  row_len: int = 2048               # tokens per packed row (multiple of 128)
  rows_per_batch: int = 4           # rows of one micro-batch
  microbatches: int = 1             # micro-batches per step (leading axis of every array)
  max_seqs: int = 32                # trajectories per micro-batch at most
  seq_len: int = 2048               # trained (assistant) tokens per trajectory at most
  seed: int = 0                     # shuffle seed
  shuffle: bool = True              # shuffle groups (differently in every epoch)
  num_epochs: Optional[int] = 1     # passes over the data; None = repeat forever
  group_by: str = "field"           # one of GROUP_BY (module docstring)
  max_group_size: Optional[int] = None  # records per tree at most (None: whole groups)
  mask_tool_errors: bool = True     # failed tool-call turns: in context, out of the loss
  skip_bad: bool = False            # log and count bad records instead of raising
  shard_index: int = 0              # this data shard (e.g. jax.process_index())
  shard_count: int = 1              # number of shards (each reads a disjoint part of the groups)
  num_threads: int = 1              # threads rendering records ahead of the packer
  prefetch: int = 16                # groups rendered ahead

  def __post_init__(self):
    def need(ok: bool, field: str, what: str):
      if not ok:
        raise ValueError(f"SFTDataConfig.{field}={getattr(self, field)!r}: expected {what}")

    def positive(field: str):
      v = getattr(self, field)
      need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, field,
           "an integer >= 1")

    if isinstance(self.sources, str):
      object.__setattr__(self, "sources", (self.sources,))
    object.__setattr__(self, "sources", tuple(self.sources))
    need(all(isinstance(s, str) and s for s in self.sources), "sources", "file paths")
    for f in ("row_len", "rows_per_batch", "microbatches", "max_seqs", "seq_len", "shard_count",
              "prefetch"):
      positive(f)
    need(self.row_len % 128 == 0, "row_len", "a multiple of 128")
    need(self.num_epochs is None or (isinstance(self.num_epochs, int) and self.num_epochs >= 1),
         "num_epochs", "None or an integer >= 1")
    need(self.group_by in GROUP_BY, "group_by", f"one of {GROUP_BY}")
    need(self.max_group_size is None or (isinstance(self.max_group_size, int)
                                         and self.max_group_size >= 1),
         "max_group_size", "None or an integer >= 1")
    need(isinstance(self.shard_index, int) and 0 <= self.shard_index < self.shard_count,
         "shard_index", f"an integer in [0, shard_count={self.shard_count})")
    need(isinstance(self.num_threads, int) and self.num_threads >= 0, "num_threads",
         "an integer >= 0")
    need(isinstance(self.seed, int) and 0 <= self.seed < 2**32, "seed",
         "an integer in [0, 2**32)")


# ----------------------------------------------------------------------------- groups

Ref = tuple[int, int, str]  # a record: (reader, key, where)


def scan_groups(readers: Sequence[Reader], group_by: str, max_group_size: Optional[int],
                skip_bad: bool) -> tuple[list[list[Ref]], list[str]]:
  """Reads every record once: checks it and finds its group.

  Args:
    readers: the record readers (files, in-memory records); a record is (reader, key, where).
    group_by: one of GROUP_BY (the module doc).
    max_group_size: records per group at most (None: whole groups).
    skip_bad: log and skip bad records instead of raising.

  Returns:
    (groups, errors): the groups as lists of (reader index, key, where) refs, in order of
    their first record and cut into chunks of max_group_size; the messages of the bad records
    skipped.

  Raises:
    RecordError: a bad record, unless skip_bad.
  """
  groups: dict[Any, list[Ref]] = {}
  errors: list[str] = []
  for r, reader in enumerate(readers):
    for key, where, record in reader.scan():
      try:
        if isinstance(record, RecordError):
          raise record
        check_record(record, where)
      except RecordError as e:
        if not skip_bad:
          raise
        log.warning("skipping bad record: %s", e)
        errors.append(str(e))
        continue
      k = group_key(record, group_by)
      groups.setdefault(("solo", r, key) if k is None else k, []).append((r, key, where))
  out = []
  size = max_group_size or sys.maxsize
  for refs in groups.values():
    out += [refs[i:i + size] for i in range(0, len(refs), size)]
  return out, errors


class _GroupSource:
  """grain random-access source: group i -> [(where, record), ...], read lazily."""

  def __init__(self, readers: Sequence[Reader], groups: list[list[Ref]]):
    self.readers, self.groups = readers, groups

  def __len__(self) -> int:
    return len(self.groups)

  def __getitem__(self, i: int) -> list[tuple[str, Any]]:
    return [(where, self.readers[r].read(key)) for r, key, where in self.groups[i]]


# ----------------------------------------------------------------------------- trees


@dataclasses.dataclass
class _Item:
  """One group, rendered: its tree, or the error that stops it."""

  where: str                    # the records it holds, for messages
  tree: Optional[Tree] = None
  num_trajectories: int = 0
  linear_tokens: int = 0        # Σ over calls of len(input) + len(output)
  error: Optional[str] = None


def _names(wheres: Sequence[str]) -> str:
  return ", ".join(wheres[:3]) + (f" and {len(wheres) - 3} more" if len(wheres) > 3 else "")


class _Render:
  """grain map: a group's records -> _Item (errors are returned, raised by the packer)."""

  def __init__(self, chat: ChatFormat, cfg: SFTDataConfig):
    self.chat, self.cfg = chat, cfg

  def __call__(self, group: list[tuple[str, Any]]) -> _Item:
    cfg = self.cfg
    where = _names([w for w, _ in group])
    trajs: list[TrajectoryTokens] = []
    try:
      for w, record in group:
        for t in record_trajectories(record, self.chat, cfg.mask_tool_errors, w):
          for c, call in enumerate(t.calls):
            n = len(call.input_ids) + len(call.output_ids)
            if n > cfg.row_len:
              raise RecordError(f"{w}: call {c} has {n} tokens (input + output), more than "
                                f"row_len={cfg.row_len}")
          sampled = sum(len(c.output_ids) for c in t.calls)
          if sampled > cfg.seq_len:
            raise RecordError(f"{w}: {sampled} trained tokens, more than seq_len={cfg.seq_len}")
          trajs.append(t)
      if len(trajs) > cfg.max_seqs:
        raise RecordError(f"{where}: the tree has {len(trajs)} trajectories, more than "
                          f"max_seqs={cfg.max_seqs} (set max_group_size)")
      tree = build_tree(trajs)
    except ValueError as e:  # RecordError, or build_tree's
      return _Item(where, error=str(e))
    linear = sum(len(c.input_ids) + len(c.output_ids) for t in trajs for c in t.calls)
    return _Item(where, tree, len(trajs), linear)


def _padding(mb: MicroBatches) -> MicroBatches:
  """One all-padding micro-batch shaped like `mb` (make_micro_batches' padding values)."""
  L = mb.tokens.shape[-1]
  zero = np.zeros_like
  return mb.replace(
      tokens=zero(mb.tokens), positions=zero(mb.positions),
      end=np.broadcast_to(np.arange(1, L + 1, dtype=np.int32), mb.end.shape).copy(),
      token_weights=zero(mb.token_weights), seq_pred=zero(mb.seq_pred),
      seq_tokens=zero(mb.seq_tokens), seq_valid=zero(mb.seq_valid),
      seq_id=np.full_like(mb.seq_id, -1), fields={k: zero(v) for k, v in mb.fields.items()},
      scalars={k: np.full_like(v, -1 if k == "group" else 0) for k, v in mb.scalars.items()})


def _step_batch(micro: list[list[_Item]], cfg: SFTDataConfig) -> MicroBatches:
  """The step's MicroBatches: each micro-batch's trees through `make_micro_batches` (which
  repeats the `pack` call that `_fit` accepted, so each gives exactly one micro-batch), then
  stacked and padded to `microbatches`. seq_id and the "group" scalar count over the step."""
  shape = BatchShape(row_len=cfg.row_len, rows=cfg.rows_per_batch, seqs=cfg.max_seqs,
                     seq_len=cfg.seq_len, micro_batches=1)
  parts, trajectories, trees = [], 0, 0
  for items in micro:
    mb = make_micro_batches([i.tree for i in items], shape)
    real = mb.seq_id >= 0
    mb.seq_id[real] += trajectories
    mb.scalars["group"][real] += trees
    trajectories += sum(i.num_trajectories for i in items)
    trees += len(items)
    parts.append(mb)
  parts += [_padding(parts[0])] * (cfg.microbatches - len(parts))
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


class _PackIterator(grain.DatasetIterator):
  """Greedy packing of rendered groups into steps of `microbatches` micro-batches."""

  def __init__(self, parent: grain.DatasetIterator, cfg: SFTDataConfig, fingerprint: str):
    super().__init__(parent)
    self._cfg, self._fingerprint = cfg, fingerprint
    self._pending: Optional[_Item] = None       # read, not yet emitted
    self._pending_state: Optional[dict] = None  # parent state before it was read
    self._counts = {"steps": 0, "trajectories": 0, "trees": 0, "skipped": 0}

  def _read(self) -> tuple[_Item, dict]:
    if self._pending is not None:
      item, state = self._pending, self._pending_state
      self._pending = self._pending_state = None
      return item, state
    state = self._parent.get_state()
    return next(self._parent), state

  def _bad(self, message: str) -> None:
    if not self._cfg.skip_bad:
      raise RecordError(message)
    log.warning("skipping: %s", message)
    self._counts["skipped"] += 1

  def _fit(self, items: list[_Item]) -> Optional[TreeBatch]:
    """The one micro-batch holding all of `items`, or None if they do not fit one."""
    cfg = self._cfg
    if (sum(len(i.tree) for i in items) > cfg.rows_per_batch * cfg.row_len
        or sum(i.num_trajectories for i in items) > cfg.max_seqs):
      return None
    try:
      batches = pack([i.tree for i in items], cfg.row_len, cfg.rows_per_batch, cfg.seq_len)
    except ValueError:  # a group needing more than rows_per_batch rows
      return None
    return batches[0] if len(batches) == 1 else None

  def _microbatch(self) -> tuple[Optional[TreeBatch], list[_Item]]:
    cfg = self._cfg
    items: list[_Item] = []
    batch = None
    while True:
      try:
        item, state = self._read()
      except StopIteration:
        break
      if item.error is not None:
        self._bad(item.error)
        continue
      fit = self._fit(items + [item])
      if fit is not None:
        items.append(item)
        batch = fit
      elif not items:
        self._bad(f"{item.where}: the tree ({len(item.tree)} tokens, {item.num_trajectories} "
                  f"trajectories) does not fit one micro-batch of rows_per_batch="
                  f"{cfg.rows_per_batch} rows of row_len={cfg.row_len}; raise them or set "
                  "max_group_size")
      else:
        self._pending, self._pending_state = item, state
        break
    return batch, items

  def __next__(self) -> dict:
    cfg = self._cfg
    micro, stats = [], dict.fromkeys(STATS, 0)
    for _ in range(cfg.microbatches):
      batch, items = self._microbatch()
      if batch is None:
        break
      micro.append(items)
      stats["trajectories"] += sum(i.num_trajectories for i in items)
      stats["trees"] += len(items)
      stats["row_tokens"] += int((batch.group >= 0).sum())
      stats["loss_tokens"] += int((batch.fields["loss_mask"] * batch.seq_valid).sum())
      stats["linear_tokens"] += sum(i.linear_tokens for i in items)
    if not micro:
      raise StopIteration
    self._counts["steps"] += 1
    self._counts["trajectories"] += stats["trajectories"]
    self._counts["trees"] += stats["trees"]
    stats["skipped"] = self._counts["skipped"]
    return {"batch": _step_batch(micro, cfg), "stats": stats}

  def get_state(self) -> dict:
    parent = self._pending_state if self._pending is not None else self._parent.get_state()
    return {"parent": parent, "fingerprint": self._fingerprint, **self._counts}

  def set_state(self, state: dict) -> None:
    if state.get("fingerprint") != self._fingerprint:
      raise ValueError(f"data iterator state is for other data or settings (fingerprint "
                       f"{state.get('fingerprint')!r}, these are {self._fingerprint!r})")
    self._parent.set_state(state["parent"])
    self._pending = self._pending_state = None
    self._counts = {k: int(state[k]) for k in self._counts}


class SFTDataset(grain.IterDataset):
  """The packed SFT pipeline (`make_sft_dataset`); iterating yields one step per item.

  Attributes:
    cfg: the SFTDataConfig.
    fingerprint: identifies the data, grouping and batching settings an iterator state is for.
    num_groups: trees per epoch in this shard, before packing.
    load_errors: messages of the bad records skipped while scanning.
  """

  def __init__(self, parent: grain.IterDataset, cfg: SFTDataConfig, fingerprint: str,
               num_groups: int, load_errors: list[str]):
    super().__init__(parent)
    self.cfg, self.fingerprint = cfg, fingerprint
    self.num_groups, self.load_errors = num_groups, load_errors

  def __iter__(self) -> _PackIterator:
    return _PackIterator(self._parent.__iter__(), self.cfg, self.fingerprint)

  def __str__(self) -> str:
    return f"SFTDataset(groups={self.num_groups}, fingerprint={self.fingerprint})"


def make_sft_dataset(cfg: SFTDataConfig, chat: ChatFormat,
                     records: Optional[Sequence[Any]] = None) -> SFTDataset:
  """The packed SFT pipeline over files and/or in-memory records.

  Every record is read and checked once here (bad ones raise, or are skipped with skip_bad);
  rendering happens lazily while iterating.

  Args:
    cfg: what to read (`cfg.sources`) and how to batch it.
    chat: the chat format (and tokenizer) that renders records into tokens.
    records: in-memory chat records (dicts) or `envs.trajectory.Trajectory` objects, read
      after the files; None: files only.

  Returns:
    The dataset; each step is {"batch": MicroBatches, "stats": dict} (the module doc).

  Raises:
    ValueError: a source file is missing, there is nothing to read, or no record is usable.
    RecordError: a bad record, unless cfg.skip_bad.
  """
  for p in cfg.sources:
    if not os.path.isfile(p):
      raise ValueError(f"SFTDataConfig.sources: {p!r}: no such file")
  readers = [reader_for(p) for p in cfg.sources]
  if records is not None:
    readers.append(MemoryReader(list(records)))
  if not readers:
    raise ValueError("SFTDataConfig.sources is empty and no records were given")
  groups, errors = scan_groups(readers, cfg.group_by, cfg.max_group_size, cfg.skip_bad)
  if not groups:
    raise ValueError(f"no usable records in {list(cfg.sources) or 'records'} "
                     f"({len(errors)} bad)")
  ds = grain.MapDataset.source(_GroupSource(readers, groups))
  if cfg.shuffle:
    ds = ds.shuffle(seed=cfg.seed)
  if cfg.shard_count > 1:
    ds = ds[cfg.shard_index::cfg.shard_count]
  num_groups = len(ds)
  ds = ds.repeat(cfg.num_epochs).map(_Render(chat, cfg))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads,
                                            prefetch_buffer_size=cfg.prefetch))
  return SFTDataset(ds, cfg, _fingerprint(cfg, chat, readers, groups), num_groups, errors)


def _fingerprint(cfg: SFTDataConfig, chat: ChatFormat, readers, groups) -> str:
  """Identifies what a state indexes: the data, its grouping and the batching settings."""
  sizes = [os.path.getsize(r.path) if hasattr(r, "path") else len(r.records) for r in readers]
  settings = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("num_threads", "prefetch")}  # speed only, not content
  # file names, not paths: a copied or moved workdir (local -> gs://) still resumes
  settings["sources"] = [os.path.basename(str(s).rstrip("/")) for s in cfg.sources]
  body = json.dumps([settings, chat.name, chat.tokenizer.vocab_size, sizes,
                     len(groups), sum(len(g) for g in groups)], sort_keys=True, default=str)
  return hashlib.sha256(body.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`python -m trainer.data train_tokenizer | demo_data ...` (see --help).

  Args:
    argv: the command-line arguments (None: sys.argv[1:]).

  Returns:
    The exit status.
  """
  p = argparse.ArgumentParser(prog="python -m trainer.data", description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  t = sub.add_parser("train_tokenizer", help="train a sentencepiece tokenizer on local text")
  t.add_argument("--input", nargs="*", default=[], help="text files to train on")
  t.add_argument("--demo_corpus", action="store_true",
                 help="also train on the bundled demo text (scripted demo episodes; no download)")
  t.add_argument("--demo_episodes", type=int, default=64, help="episodes in the demo corpus")
  t.add_argument("--vocab_size", type=int, required=True)
  t.add_argument("--out", required=True, help="output directory (tokenizer.model)")
  t.add_argument("--chat_format", default="chatml", help="whose tokens become single ids")
  t.add_argument("--special_tokens", nargs="*", default=[],
                 help="extra control tokens (single ids, never produced from text)")
  t.add_argument("--user_symbols", nargs="*", default=[],
                 help="extra user-defined tokens (single ids, matched in text)")
  t.add_argument("--model_type", default="bpe", choices=("bpe", "unigram"))
  d = sub.add_parser("demo_data", help="write scripted demo episodes as SFT data")
  d.add_argument("--tokenizer", required=True, help="tokenizer directory or file")
  d.add_argument("--chat_format", default="chatml")
  d.add_argument("--n", type=int, required=True, help="number of tasks (episodes)")
  d.add_argument("--level", type=int, default=0)
  d.add_argument("--seed", type=int, default=0, help="taskgen seed")
  d.add_argument("--start", type=int, default=0, help="index of the first task")
  d.add_argument("--error_rate", type=float, default=0.0,
                 help="fraction of episodes with a failed (error-masked) tool call")
  d.add_argument("--early_submit_rate", type=float, default=0.0,
                 help="fraction of episodes that submit after reading the file, unfixed")
  d.add_argument("--sandbox", default="bwrap", choices=("bwrap", "local"))
  d.add_argument("--verify", action="store_true", help="reward from the tests verifier")
  d.add_argument("--as_chat", action="store_true",
                 help="write chat records instead of trajectories")
  d.add_argument("--out", required=True, help="output .jsonl")
  args = p.parse_args(argv)

  if args.command == "train_tokenizer":
    if not args.input and not args.demo_corpus:
      p.error("train_tokenizer: give --input FILES and/or --demo_corpus")
    texts = read_texts(args.input)
    if args.demo_corpus:
      texts += demo_corpus(args.chat_format, args.demo_episodes, control=args.special_tokens)
    path = train_tokenizer(texts, args.vocab_size, args.out, chat_format=args.chat_format,
                           special_tokens=args.special_tokens, user_symbols=args.user_symbols,
                           model_type=args.model_type)
    print(f"wrote {path} (vocab {args.vocab_size}, {len(texts)} texts)")
    return 0
  chat = make_chat(args.chat_format, load_tokenizer(args.tokenizer))
  trajs = demo_trajectories(chat, args.n, level=args.level, seed=args.seed, start=args.start,
                            error_rate=args.error_rate, early_submit_rate=args.early_submit_rate,
                            sandbox=args.sandbox, verify=args.verify)
  write_jsonl(args.out, [chat_record(t) for t in trajs] if args.as_chat else trajs)
  print(f"wrote {len(trajs)} demo {'chat records' if args.as_chat else 'trajectories'} to "
        f"{args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

