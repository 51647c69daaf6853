"""The engine's loop: requests, the scheduler and the public API (`Engine`).

    from envs.policy import SamplingParams
    engine = Engine(model, EngineConfig(slots=8, max_seq_len=1024))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16, temperature=0))
    engine.start()                                   # or: a background thread steps the engine
    future = engine.submit([1, 2, 3], SamplingParams(max_tokens=16))   # from any thread
    engine.submit(ids, params, on_tokens=fn)         # fn(ids, logprobs, top) after each call
    engine.update_params(new_model_or_state, version=1)

How it works (all shapes static, so nothing recompiles after warm-up):
- The caches live in a pool behind the `KVCache` interface (cache.py), picked by
  `EngineConfig.cache` from `POOLS`. The loop hands the pool sequence ids and host arrays only;
  it never learns how the pool lays its memory out.
- A request of sequence `seq` (its input, plus anything already sampled) has `seq[:-1]` in its
  cache and decodes from `seq[-1]`: prefill never needs logits, and the first token is sampled
  by the same code as every other.
- Admission: a queued request enters a free slot with the cached sequence sharing its longest
  prefix (`longest_prefix`, `claim`), so G samples of a prompt prefill it once and the next
  turn of an agent episode prefills only its new tokens; a request that shares more with one
  planned in the same round waits for that one's prefill. It enters while the pool can
  `reserve` its input and one decode call.
- Prefill runs in chunks of at most `prefill_chunk` tokens per sequence, many sequences per
  call (lengths padded to a multiple of `prefill_bucket`, rows to a power of two).
- Before each decode call the running requests `reserve` the positions it writes, oldest
  first; while the pool refuses, the newest is preempted: back to the head of the queue with
  its tokens, its sequence released (cached while the pool does not need its memory, else
  prefilled again). Tokens, log-probs and versions are those of an unpreempted run.
- Decode runs `steps_per_call` steps per jitted call over the `slots` decode batch, sampling,
  log-probs and stop-token/length checks on device; the host sees the results once per call,
  checks stop strings, finishes requests and refills free slots from the queue. The call exits
  early when a slot finishes while requests are waiting.
- Weights are a jit argument: `update_params` swaps them between calls without recompiling
  (weights.py: quantized copies, LoRA adapters).
- On a device mesh (`mesh=`) the same programs run SPMD in the decode layout (layout.py).

Sampling parameters are read structurally: any object with the fields of
`envs.policy.SamplingParams` (max_tokens, temperature, top_p, top_k, stop_token_ids, stop,
seed; min_p, min_tokens, ignore_eos and constraint where present), which the trainer passes
through; the engine never builds one.

Size (~600 lines): the scheduler's steps share the slots, the queue and the pool, and read best
in one place; what is not scheduling lives in the wing's other modules (request checks,
weights, layout, pools, programs).

Log-probs are those of the model itself (temperature 1, no top-k/top-p/min-p truncation):
exactly what a teacher-forced forward pass of the finished sequence gives the trainer. The
entropy of that same distribution is reported per token too (one reduction per decode step).
A request with token masks (a grammar `constraint`, or stop ids held back by `min_tokens`)
reports those of the distribution it was drawn from: the model's, renormalised over the allowed
tokens (constraint.py). While any slot has a constraint, decode calls run one step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from models import sharding
from models.engine import cache, layout, request, weights
from models.engine import constraint as constraints
from models.engine.cache import KVCache, common_prefix
from models.engine.config import ON_UPDATE, Completion, EngineConfig
from models.engine.contiguous import CachePool
from models.engine.paged import PagedPool
from models.engine.request import Request

logger = logging.getLogger(__name__)

# EngineConfig.cache -> the pool class (a `KVCache`) an engine keeps its caches in.
POOLS: dict[str, type[KVCache]] = {"contiguous": CachePool, "paged": PagedPool}


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class Engine:
  """Batched generation for a `models.transformer.Transformer` (see module docstring).

  Thread safety: `submit`, `update_params` and `counters` may be called from any thread;
  `step`/`generate` from one thread at a time (or let `start()` run them in the background).

  Args:
    model: the Transformer (stacked or unstacked) whose weights the engine starts with.
    config: sizes and behaviour.
    detokenize: token ids -> text, needed only for requests with stop strings.
    version: policy version of the model's weights, tagged on the tokens they sample (a
      resumed RL run's engine starts at its checkpoint's version).
    mesh: None (one device), or a mesh (axes `models.sharding.MESH_AXES`) to decode on in the
      decode layout (layout.py); the model's weights may be anywhere.

  Raises:
    ValueError: an EngineConfig field is out of range for the model (or the mesh).
  """

  def __init__(self, model, config: EngineConfig = EngineConfig(),
               detokenize: Optional[Callable[[Sequence[int]], str]] = None, version: int = 0,
               mesh=None):
    self.cfg = config
    self.model_cfg = model.cfg
    self.detokenize = detokenize
    config.check(model.cfg, tuple(POOLS))
    c = config
    self.layout = None if mesh is None else layout.Layout(mesh, model.cfg)
    if self.layout is not None:
      self.layout.check(c)
    self.capacity = c.max_seq_len
    self.prefill_rows = c.prefill_rows or c.slots
    model, self._weights = weights.prepare(model, c.weight_qtype, c.act_qtype)
    if self.layout is not None:
      model = self.layout.decode_model(model)
    self._graphdef, self._state = nnx.split(model)
    # one device: weights (and the pool's caches) committed to it, as an update's arrays are,
    # so the programs compiled at the first call serve every later one
    self._device = None if self.layout is not None else cache.weights_device(self._state)
    self._state = (self.layout.place(self._state) if self.layout is not None else
                   sharding.commit(self._state, self._device))
    self.version = version
    self._pool = POOLS[c.cache].create(model, c, self._count, self.layout)
    self._admissions = 0  # admission order of running requests (preemption takes the newest)
    # Decode batch: the request in each slot.
    self._slots: list[Optional[Request]] = [None] * c.slots
    self._queue: collections.deque[Request] = collections.deque()
    self._incoming: list[Request] = []
    self._pending_update: Optional[tuple[Any, int, str]] = None
    self._lock = threading.Lock()
    self._wakeup = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._stopping = False
    self._rng = np.random.default_rng(c.seed)
    self._counters = collections.Counter()

  # ------------------------------------------------------------------ public API

  def submit(self, input_ids: Sequence[int], params: Any,
             on_tokens: Optional[Callable[[list[int], list[float], Optional[list]], None]] = None
             ) -> concurrent.futures.Future:
    """Queue a request; may be called from any thread.

    Args:
      input_ids: the prompt's token ids (non-empty, inside the vocabulary).
      params: how to sample: any object with the fields of `envs.policy.SamplingParams`
        (max_tokens, temperature, top_p, top_k, stop_token_ids, stop, seed; min_p,
        min_tokens, ignore_eos and constraint where present).
      on_tokens: progress hook for streaming, called on the engine thread after each decode
        call that added tokens, before the Future resolves, as `on_tokens(output_ids,
        logprobs, top_logprobs)` (the request's tokens so far, copies; top_logprobs None
        without `EngineConfig.top_logprobs`). A later call extends an earlier one (the
        stop-string cut only drops tokens of the current call), except when
        `on_update="restart"` starts the request over. It must be quick; if it raises, the
        error is logged and the hook dropped.

    Returns:
      A Future that resolves to the request's Completion.

    Raises:
      ValueError: bad input ids or sampling parameters for this engine.
    """
    req = self._make_request(input_ids, params)
    req.on_tokens = on_tokens
    with self._lock:
      self._incoming.append(req)
    self._wakeup.set()
    return req.future

  def generate(self, inputs: Sequence[Sequence[int]], params: Any) -> list[Completion]:
    """Run requests to completion on the calling thread (not while `start()`ed).

    Args:
      inputs: the prompts' token ids.
      params: sampling parameters (as `submit` takes) for every input, or a sequence of them,
        one per input.

    Returns:
      One Completion per input, in order.

    Raises:
      RuntimeError: the engine runs in a background thread.
      ValueError: bad inputs or parameters.
    """
    if self._thread is not None:
      raise RuntimeError("Engine.generate: the engine runs in a background thread; use submit")
    if hasattr(params, "max_tokens"):  # one set of parameters for all inputs
      params = [params] * len(inputs)
    if len(params) != len(inputs):
      raise ValueError(f"generate: {len(inputs)} inputs but {len(params)} sampling params")
    futures = [self.submit(x, p) for x, p in zip(inputs, params)]
    while not all(f.done() for f in futures):
      self.step()
    return [f.result() for f in futures]

  def update_params(self, params, version: int, on_update: Optional[str] = None) -> None:
    """Use new weights from the next decode call on; nothing recompiles.

    With `EngineConfig.weight_qtype` the new full-precision weights are quantized here (one
    jitted call) and the engine keeps the quantized copy only. A LoRA engine also takes a
    state of its adapters alone, `nnx.state(model, nnx.LoRAParam)` of the trained model
    (stacked or unstacked): they replace the engine's adapters and the frozen base stays.

    Arrays may be anywhere (e.g. the trainer's FSDP-sharded state, on the engine's mesh or
    other devices): a mesh engine places them in its decode layout by `jax.device_put`.

    Args:
      params: a Transformer (stacked or not) or the full nnx.State of one, with the shapes and
        dtypes of the model the engine was built from (full precision with `weight_qtype`).
        For a model with LoRA adapters, any nnx.State (of Variables or pure, stacked or not)
        that holds all its adapters: those variables are replaced, the others kept (e.g.
        `nnx.state(model, nnx.LoRAParam)`, plus a MoE router's bias if it trains).
      version: policy version tagged on the tokens the new weights sample.
      on_update: what in-flight requests do (see `EngineConfig.on_update`; default that).

    Raises:
      ValueError: unknown `on_update`, or weights of another structure, shape or dtype
        (adapters for an engine without them; a partial state missing adapters).
    """
    on_update = on_update or self.cfg.on_update
    if on_update not in ON_UPDATE:
      raise ValueError(f"on_update={on_update!r}: expected one of {ON_UPDATE}")
    with self._lock:  # on top of an update still waiting to be applied
      current = self._pending_update[0] if self._pending_update else self._state
    state = self._weights.convert(params, current)
    state = (self.layout.place(state) if self.layout is not None else
             sharding.commit(state, self._device))
    with self._lock:
      self._pending_update = (state, int(version), on_update)
    self._wakeup.set()

  @property
  def weights(self) -> nnx.State:
    """The (unstacked) state the engine samples with now: quantized with `weight_qtype`."""
    with self._lock:
      return self._state

  def _count(self, **deltas: int) -> None:
    with self._lock:
      self._counters.update(deltas)

  @property
  def counters(self) -> dict[str, int]:
    """A snapshot of the engine's counters.

    prefill_tokens (real tokens prefilled), prefill_padded_tokens, prefill_calls, decode_calls,
    decode_steps, decoded_tokens, cache_hits (requests that reused a prefix), reused_tokens,
    row_copies, evictions, finished, resubmitted, updates, running_peak (most requests decoding
    at once), preempted (running requests sent back to the queue for memory). A paged cache
    adds pages_allocated (fresh pages taken), pages_shared (pages a request took from a cached
    prefix instead of prefilling them), page_copies (copy-on-write), and the gauges
    pages_used and pages_peak (most pages held at once): the pool's `gauges`.
    """
    with self._lock:
      out = dict(self._counters)
    out.update(self._pool.gauges())
    return out

  def pending(self) -> int:
    """Requests queued or running."""
    with self._lock:
      incoming = len(self._incoming)
    return incoming + len(self._queue) + sum(r is not None for r in self._slots)

  def start(self) -> None:
    """Step the engine in a daemon thread until `stop()`."""
    if self._thread is None:
      self._stopping = False
      self._thread = threading.Thread(target=self._run, name="arbor-engine", daemon=True)
      self._thread.start()

  def stop(self) -> None:
    """Stop the background thread started by `start` (after its current step)."""
    if self._thread is not None:
      self._stopping = True
      self._wakeup.set()
      self._thread.join()
      self._thread = None

  def _run(self) -> None:
    while not self._stopping:
      try:
        busy = self.step()
      except Exception as e:  # keep serving: fail the requests in flight, not the thread
        self._fail_all(e)
        busy = False
      if not busy:
        self._wakeup.wait(0.05)
        self._wakeup.clear()

  def _fail_all(self, error: Exception) -> None:
    """Fail the running requests and start from an empty cache (a failed call may have
    consumed the donated pool); queued requests stay queued."""
    logger.exception("engine step failed; failing %d running requests",
                     sum(r is not None for r in self._slots))
    for i, req in enumerate(self._slots):
      if req is not None:
        self._release(req)
        self._slots[i] = None
        if not req.future.done():
          req.future.set_exception(error)
    self._pool.reset()

  # ------------------------------------------------------------------ scheduling

  def _make_request(self, input_ids: Sequence[int], params: Any) -> Request:
    ids = request.check(input_ids, params, self.cfg, self.model_cfg.vocab_size,
                        can_detokenize=self.detokenize is not None)
    if params.seed is None:
      with self._lock:  # submit may be called from many threads
        seed = int(self._rng.integers(0, 2**32))
    else:
      seed = int(params.seed) % 2**32
    return Request(ids, params, seed)

  def step(self) -> bool:
    """Runs one scheduling round.

    Applies a pending weight update, admits queued requests into free slots (prefill), then runs
    one decode call.

    Returns:
      Whether there was anything to do.
    """
    with self._lock:
      self._queue.extend(self._incoming)
      self._incoming.clear()
    updating = self._maybe_update()
    with layout.context(self.layout):  # every program call runs under the engine's mesh
      admitted = False if updating else self._admit()
      if not any(r is not None for r in self._slots):
        return admitted or updating
      self._decode_call()
    return True

  def _maybe_update(self) -> bool:
    """Swap in pending weights when allowed; True while an update waits for in-flight requests."""
    with self._lock:
      pending = self._pending_update
    if pending is None:
      return False
    state, version, on_update = pending
    running = [r for r in self._slots if r is not None]
    if running and on_update == "finish":
      return True  # drain: no admissions until the in-flight requests are done
    for i, req in enumerate(self._slots):
      if req is not None:
        self._release(req)
        self._slots[i] = None
        if on_update == "restart":
          req.output, req.logprobs, req.entropies, req.versions, req.top = [], [], [], [], []
          req.checked = 0
          req.constraint = constraints.start(req.params)
    self._queue.extendleft(reversed(running))
    with self._lock:
      self._state, self.version = state, version
      self._pending_update = None
      self._counters["updates"] += 1
      self._counters["resubmitted"] += len(running)
    return False

  def _release(self, req: Request) -> None:
    """Gives a request's sequence back to the pool (its cache stays reusable until the pool
    needs the memory)."""
    if req.sid >= 0:
      self._pool.release(req.sid)
      req.sid = -1

  def _admit(self) -> bool:
    """Moves queued requests into free slots; prefills what the cache does not hold.

    The running requests' memory for the next decode call comes first (`_reserve_running`);
    a request is admitted while the pool can reserve its input and one decode call.
    """
    admitted = False
    if self._queue:
      self._reserve_running()
    short = False  # the pool is out of memory
    while self._queue and None in self._slots and not short:
      free = self._slots.count(None)
      plan: list[tuple[Request, np.ndarray, int, int]] = []  # (request, target, cached, slot)
      deferred = []
      while self._queue and len(plan) < free:
        req = self._queue.popleft()
        target = req.seq()[:-1]
        src, m = self._pool.longest_prefix(target, self.version, self.cfg.min_prefix)
        # A request planned in this round may share more with this one than any cached
        # sequence: wait for its prefill and reuse it then.
        if any(common_prefix(t, target) > max(m, self.cfg.min_prefix - 1)
               for _, t, _, _ in plan):
          deferred.append(req)
          continue
        if not req.started:
          req.started = True
          if not req.future.set_running_or_notify_cancel():
            continue  # cancelled while queued
        slot = self._pick_slot(src, {s for *_, s in plan})
        req.sid = self._pool.claim(req, src, m, self.version, self._shard_of(slot))
        if not self._pool.reserve(req.sid, len(target) + self.cfg.steps_per_call):
          self._release(req)  # the pool keeps what it shared for later
          deferred.append(req)
          short = True
          break
        plan.append((req, target, m, slot))
      self._queue.extendleft(reversed(deferred))
      if not plan:
        break
      self._prefill([(req.sid, target, m) for req, target, m, _ in plan])
      for req, target, m, slot in plan:
        req.cached = m
        req.admission = self._admissions
        self._admissions += 1
        self._slots[slot] = req
        self._count(cache_hits=int(m > 0), reused_tokens=m)
      admitted = True
    return admitted

  def _shard_of(self, slot: int) -> int:
    """The pool's batch shard of a slot (cache.py: slots split over the shards in order)."""
    return slot * self._pool.shards // len(self._slots)

  def _pick_slot(self, src: Optional[int], taken: set[int]) -> int:
    """A free slot (not in `taken`) on the shard the pool picks for a sequence reusing
    `src`: the first free slot when the pool is not split."""
    free = [i for i, r in enumerate(self._slots) if r is None and i not in taken]
    shard = self._pool.pick_shard(src, sorted({self._shard_of(i) for i in free}))
    return next(i for i in free if self._shard_of(i) == shard)

  def _prefill(self, items: list[tuple[int, np.ndarray, int]]) -> None:
    """Prefills target[start:] of each (sequence, target, start) into the pool.

    Chunks of at most `prefill_chunk` tokens per sequence, `prefill_rows` sequences per call
    at most (padded to a power of two), lengths padded to a multiple of `prefill_bucket`
    (at most `prefill_chunk`): few shapes, few compiles.
    """
    c = self.cfg
    todo = [[sid, target, start] for sid, target, start in items if start < len(target)]
    while todo:
      batch = todo[:self.prefill_rows]
      chunks = [min(len(t) - s, c.prefill_chunk) for _, t, s in batch]
      length = min(_round_up(max(chunks), c.prefill_bucket), c.prefill_chunk)
      b = min(1 << (len(batch) - 1).bit_length(), self.prefill_rows)
      tokens = np.zeros((b, length), np.int32)
      starts = np.zeros(b, np.int32)
      for i, ((_, target, start), n) in enumerate(zip(batch, chunks)):
        starts[i] = start
        tokens[i, :n] = target[start:start + n]
      self._pool.prefill(self._graphdef, self._state, [sid for sid, _, _ in batch], tokens,
                         starts, chunks)
      for item, n in zip(batch, chunks):
        item[2] += n
      self._count(prefill_calls=1, prefill_tokens=sum(chunks), prefill_padded_tokens=b * length)
      todo = [item for item in todo if item[2] < len(item[1])]

  def _reserve_running(self) -> None:
    """Gives every running request the memory for the positions the next decode call writes,
    oldest first; while the pool is short, the newest running request is preempted."""
    for req in sorted((r for r in self._slots if r is not None), key=lambda r: r.admission):
      if req.sid < 0:
        continue  # preempted in this loop
      upto = len(req.input_ids) + len(req.output) - 1 + self.cfg.steps_per_call
      shard = self._pool.shard(req.sid)
      while not self._pool.reserve(req.sid, upto):  # the newest on the shard that is short
        victim = max((r for r in self._slots if r is not None and r.sid >= 0
                      and self._pool.shard(r.sid) == shard), key=lambda r: r.admission)
        self._preempt(victim)
        if victim is req:
          break

  def _preempt(self, req: Request) -> None:
    """Sends a running request back to the head of the queue, keeping its tokens (its
    sequence stays cached while the pool does not need the memory, else it is prefilled
    again)."""
    self._release(req)
    self._slots[self._slots.index(req)] = None
    self._queue.appendleft(req)
    self._count(preempted=1)

  def _decode_call(self) -> None:
    c = self.cfg
    self._reserve_running()
    if not any(r is not None for r in self._slots):
      return
    s, n_stop = c.slots, max(c.max_stop_token_ids, 1)
    tokens, lengths, counts, limits = (np.zeros(s, np.int32) for _ in range(4))
    active = np.zeros(s, bool)
    temperature, top_p = np.zeros(s, np.float32), np.ones(s, np.float32)
    top_k, seeds = np.zeros(s, np.int32), np.zeros(s, np.uint32)
    stop_ids = np.full((s, n_stop), -1, np.int32)
    for i, req in enumerate(self._slots):
      if req is None:
        continue
      p = req.params
      seq_len = len(req.input_ids) + len(req.output)
      active[i] = True
      tokens[i] = req.output[-1] if req.output else req.input_ids[-1]
      lengths[i] = seq_len - 1
      counts[i], limits[i] = len(req.output), p.max_tokens
      temperature[i], top_p[i], top_k[i], seeds[i] = p.temperature, p.top_p, p.top_k, req.seed
      stop_ids[i, :len(constraints.stop_ids(p))] = constraints.stop_ids(p)
    ctl = constraints.controls(self._slots, self.model_cfg.vocab_size)
    for i, error in ctl.failed:  # a constraint that allows no token fails its request alone
      req, active[i] = self._slots[i], False
      self._release(req)
      self._slots[i] = None
      req.future.set_exception(error)
    if not active.any():
      return
    max_steps = np.int32(1 if ctl.constrained else c.steps_per_call)
    waiting = bool(self._queue) or bool(self._incoming)
    sids = [r.sid if r is not None else None for r in self._slots]
    steps, _, _, _, new_counts, out = self._pool.decode(
        self._graphdef, c.steps_per_call, c.top_logprobs, c.return_expert_ids, self._state,
        sids, tokens, lengths, active, counts, limits, temperature, top_k, top_p, seeds,
        stop_ids, max_steps, np.bool_(waiting), **ctl.kwargs())
    with self._lock:
      self._counters["running_peak"] = max(self._counters["running_peak"], int(active.sum()))
    out = jax.device_get(out)
    new_counts, steps = np.asarray(new_counts), int(steps)
    emitted = 0
    for i, req in enumerate(self._slots):
      if req is None:
        continue
      n = int(new_counts[i]) - len(req.output)
      emitted += n
      req.output.extend(out["tokens"][:n, i].tolist())
      ended = constraints.advance(req.constraint, req.output[len(req.output) - n:])
      req.logprobs.extend(out["logprobs"][:n, i].tolist())
      req.entropies.extend(out["entropy"][:n, i].tolist())
      req.versions.extend([self.version] * n)
      if c.top_logprobs:
        req.top.extend([list(zip(out["top_ids"][t, i].tolist(),
                                 out["top_logprobs"][t, i].tolist())) for t in range(n)])
      reason = None
      if req.output and (ended or req.output[-1] in constraints.stop_ids(req.params)):
        reason = "stop"
      elif len(req.output) >= req.params.max_tokens:
        reason = "length"
      if req.params.stop:
        cut = self._stop_string_cut(req)
        if cut is not None:
          self._truncate(req, cut)
          reason = "stop"
      # The sequence now holds seq[:-1] (tokens past a stop-string cut are cached but not
      # counted); step t fed the token at position seq_len - 1 + t, whose experts it chose.
      experts = out["expert_ids"][:n, :, i] if c.return_expert_ids else None
      self._pool.record(req.sid, req.seq(), experts)
      if n and req.on_tokens is not None:
        self._report(req)
      if reason is not None:
        self._finish(i, req, reason)
    self._count(decode_calls=1, decode_steps=steps, decoded_tokens=emitted)

  def _stop_string_cut(self, req: Request) -> Optional[int]:
    """Smallest number of output tokens whose text contains a stop string, or None."""
    stops = req.params.stop
    window = max(map(len, stops)) + 16  # tokens that can hold a stop string (>= 1 char each)
    start = max(0, req.checked - window)
    out = req.output
    found = None
    if any(s in self.detokenize(out[start:]) for s in stops):
      for t in range(max(req.checked, 1), len(out) + 1):
        if any(s in self.detokenize(out[max(0, t - window):t]) for s in stops):
          found = t
          break
    req.checked = len(out)
    return found

  def _report(self, req: Request) -> None:
    """Calls a request's progress hook; a failing hook is dropped, the request goes on."""
    try:
      req.on_tokens(list(req.output), list(req.logprobs),
                    list(req.top) if self.cfg.top_logprobs else None)
    except Exception:  # the hook belongs to a client; it must not fail the decode batch
      logger.exception("on_tokens hook failed; dropped for the rest of the request")
      req.on_tokens = None

  def _truncate(self, req: Request, n: int) -> None:
    del req.output[n:], req.logprobs[n:], req.entropies[n:], req.versions[n:], req.top[n:]

  def _finish(self, slot: int, req: Request, reason: str) -> None:
    # the sequence holds seq[:-1]: every position fed to the model
    experts = self._pool.expert_ids(req.sid) if self.cfg.return_expert_ids else None
    self._release(req)
    self._slots[slot] = None
    self._count(finished=1)
    req.future.set_result(Completion(
        output_ids=list(req.output), logprobs=list(req.logprobs), finish_reason=reason,
        token_versions=list(req.versions), policy_version=req.versions[0],
        prompt_tokens=len(req.input_ids), cached_tokens=req.cached,
        top_logprobs=list(req.top) if self.cfg.top_logprobs else None,
        expert_ids=experts, entropies=list(req.entropies)))
