"""Generation engine: continuous batching over a bounded pool of KV-cache rows.

Size: the scheduler, both cache pools' bookkeeping and the constraint wiring are one class
for now; the engine's own package (one KV-cache interface, the loop, the sampler's programs)
is where it splits.

    from envs.policy import SamplingParams
    engine = Engine(model, EngineConfig(slots=8, max_seq_len=1024))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16, temperature=0))
    engine.start()                                   # or: a background thread steps the engine
    future = engine.submit([1, 2, 3], SamplingParams(max_tokens=16))   # from any thread
    engine.submit(ids, params, on_tokens=fn)         # fn(ids, logprobs, top) after each call
    engine.update_params(new_model_or_state, version=1)

How it works (all shapes static, so nothing recompiles after warm-up):
- The cache is a pool of `slots + prefix_cache_rows` rows, each holding the keys/values (GQA) or
  latents (MLA) of one token sequence; the host keeps each row's token ids. A request takes a
  row; the row with the longest common prefix is reused (in place when the request just extends
  it, else copied), so G samples of a prompt prefill it once and the next turn of an agent
  episode prefills only its new tokens. Rows not in use are evicted least-recently-used first.
- A request of sequence `seq` (its input, plus anything already sampled) has `seq[:-1]` in its
  row and decodes from `seq[-1]`: prefill never needs logits, and the first token is sampled by
  the same code as every other.
- Prefill runs in chunks of at most `prefill_chunk` tokens per row, many rows per call (lengths
  padded to a multiple of `prefill_bucket`, rows to a power of two).
- Decode runs `steps_per_call` steps per jitted call (a `lax.while_loop` over the `slots`
  decode batch, gathered from the pool), sampling, log-probs and stop-token/length checks on
  device; the host sees the results once per call, checks stop strings, finishes requests and
  refills free slots from the queue. The call exits early when a slot finishes while requests
  are waiting.
- Weights are a jit argument: `update_params` swaps them between calls without recompiling.

Quantized rollouts: with `EngineConfig(weight_qtype="int8")` (or "float8_e4m3fn", ...) the
engine samples from a weight-only qwix-quantized copy of the policy (`models.lora.quantize`:
projections and routed-expert stacks; with an `act_qtype` the projections' inputs are
quantized at every call too): it quantizes the model at construction and re-quantizes the
full-precision weights each `update_params` brings (one jitted call), and holds only the
quantized copy; the trainer keeps its own precision. Log-probs are the quantized model's, so
the trainer's mismatch corrections (rl.corrections) see the quantization error. A LoRA
engine (a model with `nnx.LoRAParam` adapters) takes the adapters alone in `update_params`
(`nnx.state(model, nnx.LoRAParam)` or the trainer's pure `TrainState.params`, stacked or
unstacked; with a MoE router's bias beside them when it trains): its frozen base stays where
it is and only those variables move.

With `EngineConfig(cache="paged")` the cache is a pool of `num_pages` pages of `page_size`
positions instead (models/paged_cache.py): a sequence holds the pages its positions fill, so
memory follows the tokens actually cached rather than `max_seq_len` per row, and `slots` can
exceed what a contiguous pool of the same memory runs at once.
- Prefix reuse shares pages: a request takes the pages of the longest cached prefix (G samples
  of a prompt hold its pages once; the next turn of an episode holds the previous turn's), and
  a shared partial page is copied before the request writes into it (copy-on-write).
- Admission is by free pages: a request enters a free slot while pages for its input and one
  decode call are free (idle cached sequences give theirs up, least recently used first).
- Before each decode call the running requests get pages for the positions it writes, oldest
  first; when pages run out the newest is preempted: back to the head of the queue with its
  tokens, its sequence cached while its pages are not needed, else prefilled again (recompute).
  Tokens, log-probs and versions are those of an unpreempted run.
- Decode attention reads the pages through `models.kernels.paged_attention` (the Pallas TPU
  kernel of models/kernels/paged_attention_tpu.py when kernels target a TPU).

This module holds the requests and the scheduler; models/cache_pool.py the pool of cache rows
and what each holds (models/paged_cache.py for a paged cache); models/sampler.py the jitted
prefill / copy / decode calls.

Sampling parameters are read structurally: any object with the fields of
`envs.policy.SamplingParams` (max_tokens, temperature, top_p, top_k, stop_token_ids, stop,
seed; min_p, min_tokens, ignore_eos and constraint where present), which the trainer passes
through; the engine never builds one.

Log-probs are those of the model itself (temperature 1, no top-k/top-p/min-p truncation):
exactly what a teacher-forced forward pass of the finished sequence gives the trainer. The
entropy of that same distribution is reported per token too (one reduction per decode step).
A request with token masks (a grammar `constraint`, or stop ids held back by `min_tokens`)
reports those of the distribution it was drawn from: the model's, renormalised over the allowed
tokens (models/constraint.py). While any slot has a constraint, decode calls run one step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import constraint as constraints
from models import lora, sampler, transformer
from models.cache_pool import CachePool
from models.config import BASE_QTYPES
from models.paged_cache import PagedPool

logger = logging.getLogger(__name__)

ON_UPDATE = ("finish", "resubmit", "restart")
CACHES = ("contiguous", "paged")
WEIGHT_QTYPES = BASE_QTYPES  # qwix weight types an engine may sample with
ACT_QTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")  # and activation types


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and behaviour of an Engine. Every field is checked by `Engine`."""

  slots: int = 8                  # sequences decoded together (the decode batch)
  max_seq_len: int = 2048         # longest sequence (input + output) a cache row holds
  prefix_cache_rows: int = 8      # cache rows beyond `slots`, kept for prefix reuse (LRU);
                                  # paged: most idle sequences kept for prefix reuse
  min_prefix: int = 8             # shortest cached prefix worth reusing (shorter: prefill)
  prefill_chunk: int = 512        # most tokens per row in one prefill call
  prefill_bucket: int = 64        # prefill lengths are padded to a multiple of this
  prefill_rows: int = 0           # most rows per prefill call (0 = slots)
  steps_per_call: int = 16        # decode steps per jitted call (one host round trip each)
  max_stop_token_ids: int = 8     # stop token ids a request may give
  top_logprobs: int = 0           # top-n log-probs returned per token (0 = none)
  return_expert_ids: bool = False  # MoE: return the experts of every position (routing replay)
  on_update: str = "finish"       # in-flight requests at update_params: "finish" (drain on old
                                  # weights) | "resubmit" (keep tokens, continue on new weights)
                                  # | "restart" (drop tokens, start again on new weights)
  seed: int = 0                   # seeds requests that give none
  cache: str = "contiguous"       # "contiguous": a row of max_seq_len positions per sequence |
                                  # "paged": pages of page_size positions, shared by prefixes
  page_size: int = 16             # paged: positions per page
  num_pages: int = 0              # paged: pages in the pool (0 = the contiguous pool's memory,
                                  # (slots + prefix_cache_rows) * ceil(max_seq_len / page_size))
  weight_qtype: Optional[str] = None  # None: sample with the model's own weights | a qwix type
                                  # (WEIGHT_QTYPES, e.g. "int8", "float8_e4m3fn"): sample with
                                  # a weight-only quantized copy, re-quantized at update_params
  act_qtype: Optional[str] = None  # with weight_qtype: also quantize the projections' inputs
                                  # (ACT_QTYPES; qwix's dynamic per-token absmax)


@dataclasses.dataclass
class Completion:
  """One finished request. logprobs[i] = log p(output_ids[i]) under token_versions[i]'s weights;
  entropies[i] = the entropy (nats) of that whole next-token distribution p, which sampled
  output_ids[i]."""

  output_ids: list[int]
  logprobs: list[float]
  finish_reason: str              # "stop" (stop token or string) | "length"
  token_versions: list[int]       # policy version that sampled each token
  policy_version: int             # version of the first token
  prompt_tokens: int              # len(input_ids)
  cached_tokens: int              # prefix tokens reused from the cache (last admission)
  # per token: (id, log-prob) pairs, best first
  top_logprobs: Optional[list[list[tuple[int, float]]]] = None
  # MoE routing replay: [len(input_ids) + len(output_ids) - 1, moe_layers, k] int16, the
  # experts that position p went through (prefilled, copied from a reused prefix, or decoded);
  # the last output token was never fed to the model.
  expert_ids: Optional[np.ndarray] = None
  # per output token (aligned with logprobs, cut with them at a stop string): the entropy in
  # nats of the model's next-token distribution (temperature 1, untruncated) it was drawn from
  entropies: list[float] = dataclasses.field(default_factory=list)


class _Request:
  """Host-side state of one request."""

  def __init__(self, input_ids: np.ndarray, params: Any, seed: int):
    self.input_ids = input_ids
    self.params = params
    self.seed = seed
    self.on_tokens: Optional[Callable] = None  # progress hook (see Engine.submit)
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.output: list[int] = []
    self.logprobs: list[float] = []
    self.entropies: list[float] = []
    self.versions: list[int] = []
    self.top: list[list[tuple[int, float]]] = []
    self.cached = 0
    self.started = False  # its Future is running
    self.checked = 0  # output tokens already searched for stop strings
    self.row = -1  # cache row (paged: sequence id) while running
    self.constraint = constraints.start(params)  # its TokenConstraint state, or None
    self.admission = 0  # order of its latest admission

  def seq(self) -> np.ndarray:
    return np.concatenate([self.input_ids, np.asarray(self.output, np.int32)])


def _is_unstacked(model) -> bool:
  """Whether the model keeps each layer as a Block of its own (`transformer.unstack`)."""
  return any(isinstance(s, nnx.List) for s in (model.dense_layers, model.moe_layers))


def _is_stacked_state(state: nnx.State) -> bool:
  """Whether a model state has layer stacks (an unstacked one has per-layer entries 0, 1, ...)."""
  values = nnx.to_pure_dict(state)
  return any(name in values and not all(isinstance(k, int) for k in values[name])
             for name in ("dense_layers", "moe_layers"))


def _is_adapter_state(state: Any) -> bool:
  """Whether `state` holds LoRA adapters alone (`nnx.state(model, nnx.LoRAParam)`)."""
  if not isinstance(state, nnx.State):
    return False
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return bool(variables) and all(isinstance(v, nnx.LoRAParam) for v in variables)


def _unstack_values(values: dict) -> dict:
  """A pure-dict state with each layer stack [layers, ...] split into per-layer entries
  {0: ..., 1: ...}, as `transformer.unstack` lays them out."""
  out = dict(values)
  for name in ("dense_layers", "moe_layers"):
    if name in out and not all(isinstance(k, int) for k in out[name]):
      n = jax.tree.leaves(out[name])[0].shape[0]
      out[name] = {i: jax.tree.map(lambda a, i=i: a[i], out[name]) for i in range(n)}
  return out


def _abstract(state: nnx.State) -> nnx.State:
  """The state with ShapeDtypeStruct values: its structure, shapes and dtypes, no arrays."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


def _rebuild(reference: nnx.State, params: nnx.State) -> nnx.State:
  """`params`' values in `reference`'s tree structure (a structure, shape or dtype that differs
  raises).

  Only values are taken: variable metadata (e.g. an initialiser's std) is part of a state's tree
  structure, and a different structure would retrace the engine's jitted calls.

  Args:
    reference: the state (or abstract state) whose structure the result has.
    params: a state with the same variables.

  Returns:
    A state of `reference`'s structure holding `params`' arrays.

  Raises:
    ValueError: other variables, or a variable of another shape or dtype.
  """
  new_values, old_values = nnx.to_pure_dict(params), nnx.to_pure_dict(reference)
  if jax.tree.structure(new_values) != jax.tree.structure(old_values):
    raise ValueError("update_params: the new weights do not have the engine model's "
                     "structure (other layers or parameters)")
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(old_values)]
  new_leaves, old_leaves = jax.tree.leaves(new_values), jax.tree.leaves(old_values)
  for path, a, b in zip(paths, old_leaves, new_leaves):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(f"update_params: {path} is {b.dtype}{list(b.shape)}, expected "
                       f"{a.dtype}{list(a.shape)}")
  return jax.tree.unflatten(jax.tree.structure(reference), [jnp.asarray(b) for b in new_leaves])


@functools.lru_cache(maxsize=16)
def _quantizer(graphdef: nnx.GraphDef, stacked: bool, qtype: str, act_qtype: Optional[str]
               ) -> Callable[[nnx.State], nnx.State]:
  """The jitted full-precision state -> qwix-quantized unstacked state, for a stacked or an
  unstacked model's graphdef (cached: engines and weight syncs of one model share it)."""

  def quantize(state: nnx.State) -> nnx.State:
    model = nnx.merge(graphdef, state)
    model = transformer.unstack(model) if stacked else model
    return nnx.state(lora.quantize(model, model.cfg, qtype, transformer.Transformer, act_qtype))
  return jax.jit(quantize)


_QUANTIZED_GRAPHDEFS: dict[tuple, nnx.GraphDef] = {}  # (graphdef, qtypes) -> quantized one's


def _quantized_graphdef(graphdef: nnx.GraphDef, qtype: str, act_qtype: Optional[str],
                        state: nnx.State) -> nnx.GraphDef:
  """The graphdef of an unstacked model's quantized copy.

  qwix gives every quantized copy a class of its own, so the graphdefs of two copies never
  compare equal and two engines would compile their calls twice: engines quantizing the same
  model structure to the same type share the first one's graphdef, and its compiled calls.

  Args:
    graphdef: the full-precision unstacked model's graphdef.
    qtype: the qwix weight type.
    act_qtype: the qwix activation type, or None.
    state: that model's state (only shapes are read).

  Returns:
    The quantized copy's graphdef.
  """
  key = (graphdef, qtype, act_qtype)
  if key not in _QUANTIZED_GRAPHDEFS:
    if len(_QUANTIZED_GRAPHDEFS) >= 16:
      _QUANTIZED_GRAPHDEFS.pop(next(iter(_QUANTIZED_GRAPHDEFS)))
    def quantize(s):
      model = nnx.merge(graphdef, s)
      return lora.quantize(model, model.cfg, qtype, transformer.Transformer, act_qtype)
    _QUANTIZED_GRAPHDEFS[key] = nnx.graphdef(nnx.eval_shape(quantize, state))
  return _QUANTIZED_GRAPHDEFS[key]


def _common(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the common prefix of two token arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if len(diff) else n


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

  Raises:
    ValueError: an EngineConfig field is out of range for the model.
  """

  def __init__(self, model, config: EngineConfig = EngineConfig(),
               detokenize: Optional[Callable[[Sequence[int]], str]] = None, version: int = 0):
    self.cfg = config
    self.model_cfg = model.cfg
    self.detokenize = detokenize
    self._check_config()
    c = config
    self.num_rows = c.slots + c.prefix_cache_rows
    self.paged = c.cache == "paged"
    self.num_pages = c.num_pages or self.num_rows * -(-c.max_seq_len // c.page_size)
    self.capacity = c.max_seq_len
    self.prefill_rows = c.prefill_rows or c.slots
    if c.weight_qtype is not None and (model.cfg.lora_rank or lora.has_adapters(model)):
      raise ValueError(
          f"EngineConfig.weight_qtype={c.weight_qtype!r}: the model has LoRA adapters "
          f"(ModelConfig.lora_rank={model.cfg.lora_rank}); sample from its merged weights "
          "(models.lora.merge) or quantize the frozen base with ModelConfig.base_qtype")
    if c.weight_qtype is not None and lora.is_quantized(model):
      raise ValueError(f"EngineConfig.weight_qtype={c.weight_qtype!r}: the model is quantized "
                       "already; pass its full-precision weights")
    # Decoding runs the unstacked model: every layer reads its own weight and cache buffers.
    self._stacked_graphdef = None if _is_unstacked(model) else nnx.graphdef(model)
    # weight_qtype: {stacked: (graphdef, abstract state)} of the full-precision models that
    # update_params quantizes (no full-precision array is kept)
    self._full: dict[bool, tuple[Any, nnx.State]] = {}
    if c.weight_qtype is not None and self._stacked_graphdef is not None:
      self._full[True] = (self._stacked_graphdef, _abstract(nnx.state(model)))
    model = model if _is_unstacked(model) else transformer.unstack(model)
    if c.weight_qtype is not None:
      graphdef, state = nnx.split(model)
      self._full[False] = (graphdef, _abstract(state))
      model = nnx.merge(_quantized_graphdef(graphdef, c.weight_qtype, c.act_qtype, state),
                        _quantizer(graphdef, False, c.weight_qtype, c.act_qtype)(state))
      del state  # the engine holds the quantized copy only
    self._graphdef, self._state = nnx.split(model)
    # paths of the LoRA adapters in the (unstacked) state: update_params may bring these alone
    self._adapter_paths = frozenset(path for path, _ in
                                    nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    self.version = version
    if self.paged:
      self._pool = PagedPool(model, self.num_pages, c.page_size, self.capacity, self._count,
                             experts=c.return_expert_ids, retain=c.prefix_cache_rows)
    else:
      self._pool = CachePool(model, self.num_rows, self.capacity, self._count,
                             experts=c.return_expert_ids)
    self._admissions = 0  # admission order of running requests (preemption takes the newest)
    # Decode batch: the request in each slot.
    self._slots: list[Optional[_Request]] = [None] * c.slots
    self._queue: collections.deque[_Request] = collections.deque()
    self._incoming: list[_Request] = []
    self._pending_update: Optional[tuple[Any, int, str]] = None
    self._lock = threading.Lock()
    self._wakeup = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._stopping = False
    self._rng = np.random.default_rng(c.seed)
    self._counters = collections.Counter()

  def _check_config(self) -> None:
    c, m = self.cfg, self.model_cfg

    def fail(field, why):
      raise ValueError(f"EngineConfig.{field}={getattr(c, field)!r}: {why}")

    for field in ("slots", "max_seq_len", "prefill_chunk", "prefill_bucket", "steps_per_call",
                  "min_prefix"):
      if getattr(c, field) <= 0:
        fail(field, "must be positive")
    for field in ("prefix_cache_rows", "prefill_rows", "max_stop_token_ids", "top_logprobs"):
      if getattr(c, field) < 0:
        fail(field, "must be >= 0")
    if c.top_logprobs > m.vocab_size:
      fail("top_logprobs", f"exceeds vocab_size={m.vocab_size}")
    if c.on_update not in ON_UPDATE:
      fail("on_update", f"expected one of {ON_UPDATE}")
    if c.return_expert_ids and not m.is_moe:
      fail("return_expert_ids", "the model has no MoE layers")
    if c.cache not in CACHES:
      fail("cache", f"expected one of {CACHES}")
    if c.page_size <= 0:
      fail("page_size", "must be positive")
    if c.num_pages < 0:
      fail("num_pages", "must be >= 0")
    if c.num_pages and c.num_pages * c.page_size < c.max_seq_len:
      fail("num_pages", f"x page_size={c.page_size} cannot hold one sequence of max_seq_len="
                        f"{c.max_seq_len} positions")
    if c.weight_qtype is not None and c.weight_qtype not in WEIGHT_QTYPES:
      fail("weight_qtype", f"expected None or one of {WEIGHT_QTYPES}")
    if c.act_qtype is not None and c.act_qtype not in ACT_QTYPES:
      fail("act_qtype", f"expected None or one of {ACT_QTYPES}")
    if c.act_qtype is not None and c.weight_qtype is None:
      fail("act_qtype", "quantized activations need quantized weights (weight_qtype)")

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
    if isinstance(params, nnx.State) and self._adapter_paths:
      state = self._with_leaves(params)
    elif _is_adapter_state(params):
      raise ValueError("update_params: got LoRA adapters alone, but the engine's model has "
                       "none; pass the full weights")
    else:
      stacked = (_is_stacked_state(params) if isinstance(params, nnx.State)
                 else not _is_unstacked(params))
      if isinstance(params, nnx.State) and stacked and self._stacked_graphdef is None:
        raise ValueError("update_params: got a stacked state for an engine built from an "
                         "unstacked model; pass a Transformer")
      if self.cfg.weight_qtype is not None:
        state = self._quantized(params, stacked)
      else:
        if isinstance(params, nnx.State) and stacked:
          params = nnx.merge(self._stacked_graphdef, params)
        if not isinstance(params, nnx.State):
          params = nnx.state(params if _is_unstacked(params) else transformer.unstack(params))
        state = _rebuild(self._state, params)
    with self._lock:
      self._pending_update = (state, int(version), on_update)
    self._wakeup.set()

  def _quantized(self, params, stacked: bool) -> nnx.State:
    """The engine's quantized state of new full-precision weights (`weight_qtype`)."""
    if not isinstance(params, nnx.State):
      if lora.is_quantized(params):
        raise ValueError(f"update_params: EngineConfig.weight_qtype={self.cfg.weight_qtype!r} "
                         "quantizes the weights itself; pass the full-precision model")
      if stacked and True not in self._full:  # an engine built from an unstacked model
        params, stacked = transformer.unstack(params), False
      params = nnx.state(params)
    full = _rebuild(self._full[stacked][1], params)
    quantize = _quantizer(self._full[stacked][0], stacked, self.cfg.weight_qtype,
                          self.cfg.act_qtype)
    return _rebuild(self._state, quantize(full))

  def _with_leaves(self, params: nnx.State) -> nnx.State:
    """A LoRA engine's state with the variables `params` holds replaced, the rest kept.

    Args:
      params: an nnx.State (of Variables or pure), stacked or unstacked, holding every LoRA
        adapter of the engine's model and any other of its variables (e.g. a MoE router's
        bias, which training updates beside the adapters).

    Returns:
      The new state: `params`' arrays where it has them, the engine's own elsewhere.

    Raises:
      ValueError: an adapter missing, a variable the model does not have, or one of another
        shape or dtype.
    """
    values = nnx.to_pure_dict(params)
    if _is_stacked_state(params):
      values = _unstack_values(values)
    new = nnx.traversals.flatten_mapping(values)
    with self._lock:  # on top of an update still waiting to be applied
      current = self._pending_update[0] if self._pending_update else self._state
    old = nnx.traversals.flatten_mapping(nnx.to_pure_dict(current))
    missing = sorted("/".join(map(str, p)) for p in self._adapter_paths - set(new))
    unknown = sorted("/".join(map(str, p)) for p in set(new) - set(old))
    if missing or unknown:
      raise ValueError(f"update_params: the weights are not the engine model's: adapters "
                       f"missing {missing[:3]} ({len(missing)}), unknown variables "
                       f"{unknown[:3]} ({len(unknown)})")
    for path, b in new.items():
      a = old[path]
      if jax.tree.structure(a) != jax.tree.structure(b) or any(
          x.shape != y.shape or x.dtype != y.dtype
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        raise ValueError(f"update_params: {'/'.join(map(str, path))} is "
                         f"{jax.tree.map(lambda x: (x.dtype, x.shape), b)}, expected "
                         f"{jax.tree.map(lambda x: (x.dtype, x.shape), a)}")
      old[path] = b
    leaves = jax.tree.leaves(nnx.traversals.unflatten_mapping(old))
    return jax.tree.unflatten(jax.tree.structure(self._state), [jnp.asarray(b) for b in leaves])

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
    at once). A paged cache adds pages_allocated (fresh pages taken), pages_shared (pages a
    request took from a cached prefix instead of prefilling them), page_copies
    (copy-on-write), preempted (running requests sent back to the queue for pages), and the
    gauges pages_used and pages_peak (most pages held at once).
    """
    with self._lock:
      out = dict(self._counters)
    if self.paged:
      out["pages_used"] = self._pool.pages_used
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

  def _make_request(self, input_ids: Sequence[int], params: Any) -> _Request:
    ids = np.asarray(list(input_ids), np.int64)
    vocab = self.model_cfg.vocab_size
    if ids.ndim != 1 or len(ids) == 0:
      raise ValueError("input_ids: expected a non-empty list of token ids")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if len(bad):
      raise ValueError(f"input_ids: token id {int(bad[0])} is outside the vocabulary "
                       f"[0, {vocab})")
    p = params
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
      raise ValueError(f"max_tokens={p.max_tokens!r}: must be a positive integer")
    if len(ids) + p.max_tokens > self.capacity:
      raise ValueError(f"max_tokens={p.max_tokens}: {len(ids)} input tokens + max_tokens exceed "
                       f"max_seq_len={self.capacity}")
    if not p.temperature >= 0:
      raise ValueError(f"temperature={p.temperature!r}: must be >= 0")
    if not 0 < p.top_p <= 1:
      raise ValueError(f"top_p={p.top_p!r}: must be in (0, 1]")
    if p.top_k < 0:
      raise ValueError(f"top_k={p.top_k!r}: must be >= 0")
    if len(p.stop_token_ids) > self.cfg.max_stop_token_ids:
      raise ValueError(f"stop_token_ids: {len(p.stop_token_ids)} ids, at most "
                       f"{self.cfg.max_stop_token_ids} (EngineConfig.max_stop_token_ids)")
    if any(not 0 <= t < vocab for t in p.stop_token_ids):
      raise ValueError(f"stop_token_ids={list(p.stop_token_ids)}: ids must be in [0, {vocab})")
    if p.stop and self.detokenize is None:
      raise ValueError(f"stop={list(p.stop)}: stop strings need an engine with a detokenize "
                       "callback")
    if any(not isinstance(s, str) or not s for s in p.stop):
      raise ValueError(f"stop={list(p.stop)!r}: stop strings must be non-empty strings")
    constraints.check(p)
    if p.seed is None:
      with self._lock:  # submit may be called from many threads
        seed = int(self._rng.integers(0, 2**32))
    else:
      seed = int(p.seed) % 2**32
    return _Request(ids.astype(np.int32), p, seed)

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

  def _release(self, req: _Request) -> None:
    """Give a request's row back to the pool (its cache stays reusable until evicted)."""
    if req.row >= 0:
      self._pool.release(req.row)
      req.row = -1

  def _admit(self) -> bool:
    """Move queued requests into free slots; prefill what the cache does not hold.

    With a paged cache, the running requests' pages for the next decode call come first
    (`_reserve_running`); a request is admitted while pages for its input and one decode call
    are free (idle cached sequences give theirs up).
    """
    admitted = False
    if self.paged and self._queue:
      self._reserve_running()
    short = False  # paged: out of pages
    while self._queue and None in self._slots and not short:
      free = self._slots.count(None)
      plan: list[tuple[_Request, np.ndarray, int]] = []  # (request, row target, cached length)
      deferred = []
      while self._queue and len(plan) < free:
        req = self._queue.popleft()
        target = req.seq()[:-1]
        src, m = self._pool.best_row(target, self.version, self.cfg.min_prefix)
        # A request planned in this round may share more with this one than any ready row:
        # wait for its prefill and copy from it then.
        if any(_common(t, target) > max(m, self.cfg.min_prefix - 1) for _, t, _ in plan):
          deferred.append(req)
          continue
        if not req.started:
          req.started = True
          if not req.future.set_running_or_notify_cancel():
            continue  # cancelled while queued
        req.row = self._pool.claim(req, src, m, self.version)
        if self.paged and not self._pool.reserve(req.row, len(target) + self.cfg.steps_per_call):
          self._pool.release(req.row)  # keeps what it shared for later
          req.row = -1
          deferred.append(req)
          short = True
          break
        plan.append((req, target, m))
      self._queue.extendleft(reversed(deferred))
      if not plan:
        break
      self._pool.prefill(self._graphdef, self._state,
                         [(req.row, target, m) for req, target, m in plan], self.prefill_rows,
                         self.cfg.prefill_chunk, self.cfg.prefill_bucket)
      for req, target, m in plan:
        req.cached = m
        req.admission = self._admissions
        self._admissions += 1
        self._slots[self._slots.index(None)] = req
        self._count(cache_hits=int(m > 0), reused_tokens=m)
      admitted = True
    return admitted

  def _reserve_running(self) -> None:
    """Paged cache: gives every running request pages for the positions the next decode call
    writes; while pages are short the newest running request is preempted (its sequence
    stays cached while its pages are not needed, else it is prefilled again later)."""
    for req in sorted((r for r in self._slots if r is not None), key=lambda r: r.admission):
      if req.row < 0:
        continue  # preempted in this loop
      upto = len(req.input_ids) + len(req.output) - 1 + self.cfg.steps_per_call
      while not self._pool.reserve(req.row, upto):
        victim = max((r for r in self._slots if r is not None), key=lambda r: r.admission)
        self._preempt(victim)
        if victim is req:
          break

  def _preempt(self, req: _Request) -> None:
    """Sends a running request back to the head of the queue, keeping its tokens."""
    self._release(req)
    self._slots[self._slots.index(req)] = None
    self._queue.appendleft(req)
    self._count(preempted=1)

  def _decode_call(self) -> None:
    c = self.cfg
    if self.paged:
      self._reserve_running()
      if not any(r is not None for r in self._slots):
        return
    s, n_stop = c.slots, max(c.max_stop_token_ids, 1)
    rows = np.full(s, self.num_rows, np.int32)
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
      rows[i], active[i] = req.row, True
      tokens[i] = req.output[-1] if req.output else req.input_ids[-1]
      lengths[i] = seq_len - 1
      counts[i], limits[i] = len(req.output), p.max_tokens
      temperature[i], top_p[i], top_k[i], seeds[i] = p.temperature, p.top_p, p.top_k, req.seed
      stop_ids[i, :len(constraints.stop_ids(p))] = constraints.stop_ids(p)
    ctl = constraints.controls(self._slots, self.model_cfg.vocab_size)
    for i, error in ctl.failed:  # a constraint that allows no token fails its request alone
      req, active[i], rows[i] = self._slots[i], False, self.num_rows
      self._release(req)
      self._slots[i] = None
      req.future.set_exception(error)
    if not active.any():
      return
    max_steps = np.int32(1 if ctl.constrained else c.steps_per_call)
    waiting = bool(self._queue) or bool(self._incoming)
    if self.paged:
      self._pool.flush()
      table = self._pool.table([r.row if r is not None else None for r in self._slots], s)
      self._pool.caches, steps, _, _, _, new_counts, out = sampler.decode_paged(
          self._graphdef, c.steps_per_call, c.top_logprobs, c.return_expert_ids, self._state,
          self._pool.caches, table, tokens, lengths, active, counts, limits, temperature,
          top_k, top_p, seeds, stop_ids, max_steps, np.bool_(waiting), **ctl.kwargs())
      with self._lock:
        self._counters["pages_peak"] = max(self._counters["pages_peak"], self._pool.pages_used)
    else:
      self._pool.caches, steps, _, _, _, new_counts, out = sampler.decode(
          self._graphdef, c.steps_per_call, c.top_logprobs, c.return_expert_ids, self._state,
          self._pool.caches, rows, tokens, lengths, active, counts, limits, temperature,
          top_k, top_p, seeds, stop_ids, max_steps, np.bool_(waiting), **ctl.kwargs())
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
      if c.return_expert_ids:  # step t fed the token at position seq_len - 1 + t
        fed = len(req.input_ids) + len(req.output) - 1
        self._pool.expert_row(req.row)[fed:fed + n] = out["expert_ids"][:n, :, i]
      req.output.extend(out["tokens"][:n, i].tolist())
      ended = constraints.advance(req.constraint, req.output[len(req.output) - n:])
      req.logprobs.extend(out["logprobs"][:n, i].tolist())
      req.entropies.extend(out["entropy"][:n, i].tolist())
      req.versions.extend([self.version] * n)
      if c.top_logprobs:
        req.top.extend([list(zip(out["top_ids"][t, i].tolist(), out["top_logprobs"][t, i].tolist()))
                        for t in range(n)])
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
      # The row now holds seq[:-1] (tokens past a stop-string cut are cached but not counted).
      self._pool.record(req.row, req.seq())
      if n and req.on_tokens is not None:
        self._report(req)
      if reason is not None:
        self._finish(i, req, reason)
    self._count(decode_calls=1, decode_steps=steps, decoded_tokens=emitted)

  def _stop_string_cut(self, req: _Request) -> Optional[int]:
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

  def _report(self, req: _Request) -> None:
    """Calls a request's progress hook; a failing hook is dropped, the request goes on."""
    try:
      req.on_tokens(list(req.output), list(req.logprobs),
                    list(req.top) if self.cfg.top_logprobs else None)
    except Exception:  # the hook belongs to a client; it must not fail the decode batch
      logger.exception("on_tokens hook failed; dropped for the rest of the request")
      req.on_tokens = None

  def _truncate(self, req: _Request, n: int) -> None:
    del req.output[n:], req.logprobs[n:], req.entropies[n:], req.versions[n:], req.top[n:]

  def _finish(self, slot: int, req: _Request, reason: str) -> None:
    experts = None
    if self.cfg.return_expert_ids:  # the row holds seq[:-1]
      experts = self._pool.expert_row(req.row)[:len(req.seq()) - 1].copy()
    self._release(req)
    self._slots[slot] = None
    self._count(finished=1)
    req.future.set_result(Completion(
        output_ids=list(req.output), logprobs=list(req.logprobs), finish_reason=reason,
        token_versions=list(req.versions), policy_version=req.versions[0],
        prompt_tokens=len(req.input_ids), cached_tokens=req.cached,
        top_logprobs=list(req.top) if self.cfg.top_logprobs else None,
        expert_ids=experts, entropies=list(req.entropies)))
