"""SFT data pipeline (trainer.data), tokenizer training and demo data.

References are independent of the code under test: the chat module's full `render` of each
conversation (ids and loss mask), hand-written expected texts, the Trajectory records as the
scaffold wrote them, and the uninterrupted run for resumption. Packed batches are decoded back
from the rows' positions and `end` alone (each sampled token's context is its predictor's root
path), so a test sees what the model would see.
"""

import collections
import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

from envs.chat import load_tokenizer, make_chat
from rl.tree import CallTokens, TrajectoryTokens
from trainer import data
from trainer.data import (RecordError, SFTDataConfig, conversation_calls, failed_turns,
                          make_sft_dataset, record_trajectories, write_jsonl)
from trainer.demo_data import chat_record, demo_corpus, demo_trajectories
from trainer.tokenizer_train import hf_tokenizer, train_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def call(name, **args):
  return {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": name, "arguments": args}}]}


def conversation(i=0):
  """system, user, then: a good call, a call flagged tool_error, a call whose tool result has
  error: true, an untrained reply, a user turn and a final answer."""
  return [
      {"role": "system", "content": "You fix bugs."},
      {"role": "user", "content": f"Task {i}: fix add() in calc.py"},
      call("read_file", path="calc.py"),
      {"role": "tool", "content": "def add(a, b):\n    return a - b\n"},
      {**call("read_file", path="nope.py"), "tool_error": True},
      {"role": "tool", "content": "error: no such file"},
      call("read_file", path="calc2.py"),
      {"role": "tool", "content": "error: no such file", "error": True},
      {"role": "assistant", "content": "Thinking out loud.", "train": False},
      {"role": "user", "content": "go on"},
      {"role": "assistant", "content": f"Replace `a - b` by `a + b` ({i})."},
  ]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tok")
  train_tokenizer(demo_corpus("chatml", 8) + [json.dumps(TOOLS)], 640, str(d))
  return str(d)


@pytest.fixture(scope="module")
def chat(tok_dir):
  return make_chat("chatml", load_tokenizer(tok_dir))


@pytest.fixture(scope="module")
def demo(chat):
  """Real episodes in bwrap sandboxes; every second one has a failed str_replace first."""
  return demo_trajectories(chat, 6, level=0, seed=3, error_rate=0.5)


def decode_batch(step):
  """Per micro-batch, per valid sequence: [(context ids, sampled token, fields)] read from the
  rows alone. A token's context is the root path of its predictor (seq_pred); the parent of
  row position c is the nearest position before it one level up (pre-order), and c must lie in
  that parent's subtree (`end`), so attention lets c see it."""
  mb = step["batch"]
  M, R, L = mb.tokens.shape
  out = []
  for m in range(M):
    tokens, pos, end = mb.tokens[m].reshape(-1), mb.positions[m].reshape(-1), mb.end[m]

    def parent(f):
      if pos[f] == 0:
        return -1
      p = f - 1
      while pos[p] != pos[f] - 1:
        p -= 1
      assert p // L == f // L and end[f // L, p % L] > f % L
      return p

    def path(f):
      ids = []
      while f >= 0:
        ids.append(int(tokens[f]))
        f = parent(f)
      return ids[::-1]

    seqs = []
    for s in np.flatnonzero(mb.seq_valid[m].any(-1)):
      n = int(mb.seq_valid[m, s].sum())
      assert mb.seq_valid[m, s, :n].all()
      seq, context, prev = [], None, None
      for j in range(n):
        f, t = int(mb.seq_pred[m, s, j]), int(mb.seq_tokens[m, s, j])
        fields = tuple(sorted((k, float(v[m, s, j])) for k, v in mb.fields.items()))
        if j and tokens[f] == seq[-1][1] and parent(f) == prev:  # the previous token's node
          context = context + [seq[-1][1]]
        else:
          context = path(f)
        assert pos[f] == len(context) - 1
        seq.append((tuple(context), t, fields))
        prev = f
      seqs.append(seq)
    out.append(seqs)
  return out


def expected_entries(trajectory):
  """The same view of a TrajectoryTokens: (context, sampled token, fields) per output token."""
  out = []
  for c, call_ in enumerate(trajectory.calls):
    for k, t in enumerate(call_.output_ids):
      f = {name: float(v[k]) for name, v in call_.fields.items()}
      out.append((tuple(call_.input_ids) + tuple(call_.output_ids[:k]), int(t),
                  tuple(sorted({**f, "turn": float(c)}.items()))))
  return out


def assert_batches_hold(batches, trajectories_per_record):
  """Every trajectory of every record appears exactly once, token for token."""
  want = collections.Counter()
  for trajs in trajectories_per_record:
    for t in trajs:
      want[repr(expected_entries(t))] += 1
  got = collections.Counter(repr(seq) for b in batches for mb in decode_batch(b) for seq in mb)
  assert got == want


def assert_steps_equal(a, b):
  assert a["stats"] == b["stats"]
  assert jax.tree.structure(a["batch"]) == jax.tree.structure(b["batch"])
  jax.tree.map(np.testing.assert_array_equal, a["batch"], b["batch"])


# ----------------------------------------------------------------------------- rendering


def test_failed_turns_convention():
  assert [i for i, f in enumerate(failed_turns(conversation())) if f] == [4, 6]


def test_calls_follow_the_rendered_conversation(chat):
  msgs = conversation()
  calls = conversation_calls(chat, msgs, TOOLS)
  assert len(calls) == 5
  for prev, c in zip(calls, calls[1:]):  # each call's input extends the previous call
    assert list(c.input_ids[:len(prev.input_ids) + len(prev.output_ids)]) == (
        list(prev.input_ids) + list(prev.output_ids))
  # Reference: the chat module's full rendering, failed turns marked untrained.
  ref = chat.render([{**m, "train": False} if i in (4, 6) else m for i, m in enumerate(msgs)],
                    TOOLS, add_generation_prompt=False)
  last = list(calls[-1].input_ids) + list(calls[-1].output_ids)
  assert ref.ids[:len(last)] == last and len(ref.ids) - len(last) == 1  # the closing "\n"
  mask = np.zeros(len(ref.ids), int)
  for c in calls:
    mask[len(c.input_ids):len(c.input_ids) + len(c.output_ids)] = c.fields["loss_mask"]
  assert mask.tolist() == ref.loss_mask
  # Hand-written texts of the sampled turns (the Hermes tool-call syntax, then <|im_end|>).
  dec = chat.tokenizer.decode
  assert dec(calls[0].output_ids) == ('<tool_call>\n{"name": "read_file", "arguments": '
                                      '{"path": "calc.py"}}\n</tool_call><|im_end|>')
  assert dec(calls[4].output_ids) == "Replace `a - b` by `a + b` (0).<|im_end|>"
  assert dec(calls[1].input_ids).endswith("<|im_start|>assistant\n")
  assert [c.fields["loss_mask"][0] for c in calls] == [1, 0, 0, 0, 1]
  assert [c.fields["failed"][0] for c in calls] == [0, 1, 1, 0, 0]
  unmasked = conversation_calls(chat, msgs, TOOLS, mask_tool_errors=False)
  assert [c.fields["loss_mask"][0] for c in unmasked] == [1, 1, 1, 0, 1]
  assert [c.input_ids for c in unmasked] == [c.input_ids for c in calls]


def test_error_masked_turns_stay_in_context(chat):
  cfg = SFTDataConfig(row_len=1024, rows_per_batch=2, max_seqs=4, seq_len=128, shuffle=False)
  (batch,) = list(make_sft_dataset(cfg, chat, records=[{"messages": conversation(),
                                                        "tools": TOOLS}]))
  ((seq,),) = decode_batch(batch)
  failed_ids = chat.assistant_ids(conversation()[4])
  trained = [t for _, t, f in seq if dict(f)["loss_mask"]]
  masked = [t for _, t, f in seq if not dict(f)["loss_mask"]]
  assert masked[:len(failed_ids)] == failed_ids       # sampled, but not trained
  final_context = list(seq[-1][0])                    # what the last turn is predicted from
  at = next(i for i in range(len(final_context)) if
            final_context[i:i + len(failed_ids)] == failed_ids)
  assert at > 0                                       # the failed turn is in its context
  assert sum(batch["batch"].fields["loss_mask"].ravel()) == len(trained) == \
      batch["stats"]["loss_tokens"]
  assert sum(batch["batch"].fields["failed"].ravel()) == len(failed_ids) + len(
      chat.assistant_ids(conversation()[6]))


# ----------------------------------------------------------------------------- trees


def test_branches_and_groups_form_trees(chat):
  base = conversation(1)[:4]
  records = [
      {"messages": base, "tools": TOOLS, "branches": [
          [call("read_file", path="x.py"), {"role": "tool", "content": "x"},
           {"role": "assistant", "content": "Done x."}],
          [{"role": "assistant", "content": "Done."}]]},
      {"messages": base + [{"role": "assistant", "content": "Other."}], "tools": TOOLS,
       "group": "g"},
      {"messages": base + [{"role": "assistant", "content": "Another."}], "tools": TOOLS,
       "group": "g"},
      {"messages": conversation(2), "tools": TOOLS},
  ]
  cfg = SFTDataConfig(row_len=1024, rows_per_batch=4, max_seqs=8, seq_len=128, shuffle=False)
  batches = list(make_sft_dataset(cfg, chat, records=records))
  failed = [{**m, "train": False} if i in (4, 6) else m for i, m in enumerate(conversation(2))]
  convs = [base + records[0]["branches"][0], base + records[0]["branches"][1],
           records[1]["messages"], records[2]["messages"], failed]
  # Reference: each conversation rendered on its own by the chat module.
  per_record = [record_trajectories(r, chat) for r in records]
  for t, conv in zip([t for ts in per_record for t in ts], convs):
    ref = chat.render(conv, TOOLS, add_generation_prompt=False)
    last = list(t.calls[-1].input_ids) + list(t.calls[-1].output_ids)
    assert ref.ids[:len(last)] == last
    sampled = [x for c in t.calls for x, m in zip(c.output_ids, c.fields["loss_mask"]) if m]
    assert sampled == [x for x, m in zip(ref.ids, ref.loss_mask) if m]
  assert_batches_hold(batches, per_record)
  # Trees: the four conversations of record 0 and group "g" share their prompt once.
  (b,) = batches
  groups = b["batch"].scalars["group"][0][b["batch"].seq_valid[0].any(-1)]
  assert sorted(collections.Counter(groups.tolist()).values()) == [1, 2, 2]
  assert b["stats"]["trees"] == 3 and b["stats"]["trajectories"] == 5
  prompt = len(chat.render(base[:2], TOOLS).ids)
  assert b["stats"]["row_tokens"] < sum(len(t.calls[-1].input_ids) + len(t.calls[-1].output_ids)
                                       for ts in per_record for t in ts) - 2 * prompt
  for group_by, trees in (("prompt", 2), ("none", 4)):  # the same prompt / a record's branches
    (b,) = list(make_sft_dataset(dataclasses.replace(cfg, group_by=group_by), chat,
                                 records=records))
    assert b["stats"]["trees"] == trees
    assert_batches_hold([b], per_record)


# ----------------------------------------------------------------------------- pipeline


def test_packed_batches_hold_every_record_each_epoch(chat, demo):
  records = [chat_record(t) for t in demo] + [{"messages": conversation(i), "tools": TOOLS}
                                              for i in range(4)]
  cfg = SFTDataConfig(row_len=2048, rows_per_batch=2, microbatches=2, max_seqs=6, seq_len=256,
                      num_epochs=2, group_by="system", max_group_size=3)
  ds = make_sft_dataset(cfg, chat, records=records)
  batches = list(ds)
  for b in batches:  # fixed shapes; group ids unique within a step
    mb = b["batch"]
    assert mb.tokens.shape == (2, 2, 2048) and mb.seq_tokens.shape == (2, 6, 256)
    assert set(mb.fields) == {"loss_mask", "failed", "turn"}
    n = b["stats"]["trajectories"]
    assert sorted(mb.seq_id[mb.seq_id >= 0].tolist()) == list(range(n))
    # token_weights: each position counts the calls whose sequence holds it (unpacked tokens)
    assert mb.token_weights.sum() == b["stats"]["linear_tokens"]
  per_record = [record_trajectories(r, chat) for r in records]
  assert_batches_hold(batches, per_record * 2)
  assert sum(int(b["stats"]["trajectories"]) for b in batches) == 2 * len(records)
  # Trees of records sharing the agent prompt are smaller than the trajectories laid end to end.
  assert sum(int(b["stats"]["row_tokens"]) for b in batches) < sum(
      len(t.calls[-1].input_ids) + len(t.calls[-1].output_ids) for ts in per_record * 2
      for t in ts)


def test_resume_from_state_equals_uninterrupted_run(chat, demo):
  records = [chat_record(t) for t in demo] + [{"messages": conversation(i), "tools": TOOLS,
                                               "group": i % 2} for i in range(6)]
  cfg = SFTDataConfig(row_len=2048, rows_per_batch=2, microbatches=2, max_seqs=6, seq_len=256,
                      num_epochs=3, seed=5, num_threads=1)
  full = list(make_sft_dataset(cfg, chat, records=records))
  assert len(full) >= 5
  for k in (1, 3, len(full) - 1):
    it = iter(make_sft_dataset(cfg, chat, records=records))
    for _ in range(k):
      next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    fresh = make_sft_dataset(dataclasses.replace(cfg, num_threads=0), chat,
                             records=records)
    it2 = iter(fresh)
    it2.set_state(state)
    rest = list(it2)
    assert len(rest) == len(full) - k
    for a, b in zip(rest, full[k:]):
      assert_steps_equal(a, b)
  other = make_sft_dataset(dataclasses.replace(cfg, seed=6), chat, records=records)
  with pytest.raises(ValueError, match="fingerprint"):
    iter(other).set_state(state)


def test_state_survives_a_moved_data_file(chat, demo, tmp_path):
  """A workdir copied elsewhere (local -> gs://, another disk) resumes: the fingerprint holds
  the data's names and sizes, not where it lives."""
  lines = "".join(json.dumps(chat_record(t)) + "\n" for t in demo)
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  for d in "ab":
    (tmp_path / d / "train.jsonl").write_text(lines)
  cfg = SFTDataConfig(sources=(str(tmp_path / "a" / "train.jsonl"),), row_len=2048,
                      rows_per_batch=2, max_seqs=6, seq_len=256, num_epochs=2)
  it = iter(make_sft_dataset(cfg, chat))
  next(it)
  moved = dataclasses.replace(cfg, sources=(str(tmp_path / "b" / "train.jsonl"),))
  it2 = iter(make_sft_dataset(moved, chat))
  it2.set_state(json.loads(json.dumps(it.get_state())))
  assert_steps_equal(next(it2), next(it))


def test_bad_lines_name_file_line_and_field(chat, tmp_path):
  good = json.dumps({"messages": conversation(), "tools": TOOLS})
  long = json.dumps({"messages": [{"role": "user", "content": "long " * 2000},
                                  {"role": "assistant", "content": "ok"}]})
  bad = ["{not json", json.dumps({"text": "hi"}),
         json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
         json.dumps({"messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": None, "tool_calls": "oops"}]}),
         json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
         json.dumps({"calls": [{"input_ids": [], "output_ids": [1]}]})]
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join([good] + bad + ["", long]) + "\n")  # a blank line is no record
  cfg = SFTDataConfig(sources=(str(path),), row_len=1024, rows_per_batch=2, max_seqs=4,
                      seq_len=128)
  with pytest.raises(RecordError, match="bad.jsonl:2: not valid JSON"):
    make_sft_dataset(cfg, chat)
  ds = make_sft_dataset(dataclasses.replace(cfg, skip_bad=True), chat)
  expect = ["bad.jsonl:2: not valid JSON", "bad.jsonl:3: expected a 'messages' field",
            r"bad.jsonl:4: field messages\[0\].role='robot'",
            r"bad.jsonl:5: field messages\[1\].tool_calls='oops'",
            "bad.jsonl:6: field messages: no assistant message",
            r"bad.jsonl:7: field calls\[0\].input_ids is empty"]
  assert len(ds.load_errors) == len(expect) and ds.num_groups == 2
  for message, pattern in zip(ds.load_errors, expect):
    assert re.search(pattern, message), (message, pattern)
  batches = list(ds)  # the long record fails when rendered: counted, not raised
  assert int(batches[-1]["stats"]["skipped"]) == 1
  assert sum(int(b["stats"]["trajectories"]) for b in batches) == 1
  only_long = tmp_path / "long.jsonl"
  only_long.write_text(good + "\n" + long + "\n")
  with pytest.raises(RecordError, match=r"long.jsonl:2: call 0 has \d+ tokens .*row_len=1024"):
    list(make_sft_dataset(dataclasses.replace(cfg, sources=(str(only_long),)),
                          chat))


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="row_len=1000: expected a multiple of 128"):
    SFTDataConfig(row_len=1000)
  with pytest.raises(ValueError, match="group_by='tree'"):
    SFTDataConfig(group_by="tree")
  with pytest.raises(ValueError, match="num_epochs=0"):
    SFTDataConfig(num_epochs=0)


# ----------------------------------------------------------------------------- inputs


def test_trajectory_files_and_formats_agree(chat, demo, tmp_path):
  """Trajectories as JSONL, msgpack and objects give the same batches as their chat records as
  JSONL and Parquet; a call's meta["tool_error"] masks it."""
  assert any(c.meta["tool_error"] for t in demo for c in t.calls)
  write_jsonl(str(tmp_path / "t.jsonl"), demo)
  (tmp_path / "t.msgpack").write_bytes(b"".join(t.to_bytes() for t in demo))
  records = [chat_record(t) for t in demo]
  write_jsonl(str(tmp_path / "c.jsonl"), records)
  sources = [("t.jsonl",), ("t.msgpack",), ("c.jsonl",), None]
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{**r, "tools": json.dumps(r["tools"])} for r in records]  # nested messages
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "c.parquet"))
    sources.append(("c.parquet",))
  except ImportError:
    pass
  outs = []
  for s in sources:
    cfg = SFTDataConfig(sources=tuple(str(tmp_path / f) for f in s or ()), row_len=2048,
                        rows_per_batch=2, max_seqs=4, seq_len=256, seed=1)
    outs.append(list(make_sft_dataset(cfg, chat, records=demo if s is None else None)))
  for other in outs[1:]:
    assert len(other) == len(outs[0])
    for a, b in zip(other, outs[0]):
      assert_steps_equal(a, b)
  # Reference: the calls as the scaffold recorded them; a call that failed is not trained.
  want = [[TrajectoryTokens([CallTokens(c.input_ids, c.output_ids, {
      "loss_mask": [float(not c.meta["tool_error"])] * len(c.output_ids),
      "failed": [float(c.meta["tool_error"])] * len(c.output_ids)}) for c in t.calls])]
      for t in demo]
  assert_batches_hold(outs[0], want)


def test_demo_trajectories_are_real_episodes(chat, demo):
  for t in demo:
    assert t.termination == "submitted" and t.metadata["verified"] is False
    for prev, c in zip(t.calls, t.calls[1:]):  # sampled ids never re-tokenized
      assert c.input_ids[:len(prev.input_ids) + len(prev.output_ids)] == (
          prev.input_ids + prev.output_ids)
    names = [m["tool_calls"][0]["function"]["name"] for m in t.metadata["messages"]
             if m["role"] == "assistant"]
    errors = [c.meta["tool_error"] for c in t.calls]
    assert names[:2] == ["search", "read_file"] and names[-2:] == ["str_replace", "submit"]
    assert errors == ([False, False, True, False, False] if len(names) == 5 else [False] * 4)
    # Real observations: the search names the file, the file as the sandbox holds it, the edit.
    fix = t.metadata["fix_edit"]
    tool_out = [m["content"] for m in t.metadata["messages"] if m["role"] == "tool"]
    assert any(line.startswith(f"{fix['path']}:") for line in tool_out[0].splitlines())
    assert fix["old"] in tool_out[1]
    assert f"edited {fix['path']}" in tool_out[-2] and fix["new"] in tool_out[-2]
  assert {len(t.calls) for t in demo} == {4, 5}
  (verified,) = demo_trajectories(chat, 1, level=1, seed=3, verify=True)
  assert verified.reward == 1.0 and verified.metadata["verified"] is True


def test_early_submit_episodes_end_unfixed_and_fail_the_tests(chat):
  """The noisy demonstrator: submits after the read, and the tests (a real run) say so."""
  early = demo_trajectories(chat, 2, level=0, seed=3, early_submit_rate=1.0, verify=True)
  for t in early:
    names = [m["tool_calls"][0]["function"]["name"] for m in t.metadata["messages"]
             if m["role"] == "assistant"]
    assert names == ["search", "read_file", "submit"] and t.termination == "submitted"
    assert t.reward == 0.0 and t.metadata["verified"] is True
  with pytest.raises(ValueError, match="early_submit_rate=1.5"):
    demo_trajectories(chat, 1, early_submit_rate=1.5)


def test_minimal_edit_is_unique_and_equals_the_reference_fix():
  from envs.taskgen import generate
  from trainer.demo_data import minimal_edit
  for level in (0, 1, 2, 3):
    for index in range(40):
      g = generate(level, 7, index)
      fix = g.fix_edit
      text = g.files[fix["path"]].decode()
      old, new = minimal_edit(text, fix["old"], fix["new"])
      assert text.count(old) == 1 and len(old) <= len(fix["old"])
      assert text.replace(old, new) == text.replace(fix["old"], fix["new"])


# ----------------------------------------------------------------------------- tokenizer


CODE = ["def f(x):\n    return x + 1\n", "\tif a <= b:\n\t\tpass  # tab\n", "naïve — ünïcode ✓\n",
        "<|im_end|> is text here", "  trailing spaces   \n\n\n", "x=1;y=2"]


def test_train_tokenizer_command(tmp_path):
  text = tmp_path / "code.py"
  text.write_text("\n".join(CODE) * 20)
  out = tmp_path / "tok"
  assert data.main(["train_tokenizer", "--input", str(text), "--demo_corpus",
                    "--demo_episodes", "4", "--vocab_size", "600", "--out", str(out),
                    "--special_tokens", "<|extra|>"]) == 0
  tok = load_tokenizer(str(out))
  assert tok.vocab_size == 600 and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
  for name in ("<|im_start|>", "<|im_end|>", "<|extra|>"):  # control: single ids, never text
    i = tok.token_to_id(name)
    assert i is not None and i in tok.special_ids and i not in tok.encode("a" + name + "b")
    assert tok.decode([i]) == name
  for name in ("<tool_call>", "</tool_call>", "<tool_response>"):  # user-defined: matched
    assert tok.encode(name) == [tok.token_to_id(name)]
  for s in CODE:
    assert tok.decode(tok.encode(s)) == s
  for a, b in zip(CODE, CODE[1:]):  # pieces concatenate: no dummy prefix, nothing normalised
    assert tok.decode(tok.encode(a) + tok.encode(b)) == a + b
  chat = make_chat("chatml", tok)  # and the chat format works with it
  assert chat.parse_assistant(chat.assistant_ids(call("read_file", path="a.py"))).tool_calls[
      0].arguments == {"path": "a.py"}
  with pytest.raises(ValueError, match="vocab_size=100000"):
    train_tokenizer(["tiny text"], 100000, str(tmp_path / "big"))


def test_hf_tokenizer_has_the_sentencepiece_ids(tok_dir):
  """The tokenizer.json an export writes encodes and decodes as sentencepiece itself does."""
  import sentencepiece as spm
  path = os.path.join(tok_dir, "tokenizer.model")
  sp, hf = spm.SentencePieceProcessor(model_file=path), hf_tokenizer(path)
  rng = np.random.default_rng(0)
  alphabet = list("ab c\n\t0123456789é中✓<>/_{}\"'()[]:;.,xyz  ") + ["<tool_call>", "\x00"]
  texts = CODE + demo_corpus("chatml", 2) + ["".join(rng.choice(alphabet, rng.integers(1, 120)))
                                             for _ in range(200)]
  for text in texts:
    ids = sp.encode(text)
    assert hf.decode(ids, skip_special_tokens=False) == text
    if "<|im_" not in text:  # transformers matches control pieces in text, as chat templates need
      assert hf.encode(text, add_special_tokens=False).ids == ids, text
  hf.encode_special_tokens = True  # ... unless told not to: then every text agrees
  for text in texts:
    assert hf.encode(text, add_special_tokens=False).ids == sp.encode(text), text
  for piece in ("<|im_start|>", "<|im_end|>", "</s>"):  # control pieces: special added tokens
    assert hf.token_to_id(piece) == sp.piece_to_id(piece)
  unigram = train_tokenizer(CODE * 5, 305, os.path.join(tok_dir, "uni"), model_type="unigram")
  with pytest.raises(ValueError, match="not a sentencepiece BPE model"):
    hf_tokenizer(unigram)
