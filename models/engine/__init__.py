"""The generation engine: continuous batching of sampling requests over a pool of KV caches,
for serving and RL rollouts, with the same model code the trainer scores with.

    from envs.policy import SamplingParams
    from models.engine import Engine, EngineConfig
    engine = Engine(model, EngineConfig(slots=8, max_seq_len=1024))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16, temperature=0))
    engine.update_params(new_model_or_state, version=1)

The wing owns everything between a request's token ids and its `Completion`: scheduling,
the decode caches, the jitted prefill/decode programs, sampling and token masks, and the
weights it samples with (weight updates, quantized copies). Modules, one concern each:

- loop.py: `Engine`: the request queue, admission, prefill chunking, preemption, the decode
  call and finishing requests; the registry `POOLS` of KV-cache pools.
- config.py: `EngineConfig` (sizes and behaviour) and `Completion` (one finished request).
- request.py: a request's host-side state, and the checks of what a client submits.
- weights.py: the unstacked (optionally qwix-quantized) decode model and the conversion of the
  weights `update_params` brings (full models, states, LoRA adapters) into its state.
- cache.py: `KVCache`, the interface every pool implements: sequences, prefix lookup,
  claim/reserve/release, the prefill and decode calls, what it records per position.
- contiguous.py: `CachePool`, one row of `max_seq_len` positions per sequence.
- paged.py: `PagedPool` and its `PageAllocator`: pages shared by common prefixes,
  copy-on-write, memory that follows the tokens cached.
- programs.py: the jitted programs (prefill, prefix copies, the decode loop) the pools call.
- layout.py: `Layout`, the decode layout on a device mesh (`Engine(..., mesh=mesh)`): where
  the weights, caches and slots live.
- sampling.py: the decode program's sampling math: temperature, min-p, top-k, top-p,
  entropy, token masks.
- constraint.py: token constraints (grammars, min_tokens, ignore_eos, min_p) and their masks
  on the host.

models/decode.py stays outside: it is the model's plain reference decoder (one batch, no
scheduling), which tests check the model's decode path with independently of this engine.
"""

from models.engine.cache import KVCache
from models.engine.config import Completion, EngineConfig
from models.engine.constraint import Constraint, TokenConstraint
from models.engine.contiguous import CachePool
from models.engine.loop import POOLS, Engine
from models.engine.paged import PageAllocator, PagedPool

__all__ = ["CachePool", "Completion", "Constraint", "Engine", "EngineConfig", "KVCache",
           "POOLS", "PageAllocator", "PagedPool", "TokenConstraint"]
