"""Building blocks: parameters with logical axes, RMSNorm, projections, SwiGLU MLP.

Every parameter carries its logical axis names in the `axes` metadata (e.g. `("embed", "mlp")`);
models/sharding.py maps them to mesh axes with the config's rules table. Parameters are fp32;
computation casts them to the configured dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.sharding import constrain


class RouterBias(nnx.Variable):
  """Aux-loss-free expert selection bias: state updated outside the gradient, never trained."""


def param(shape: tuple[int, ...], axes: tuple[str, ...], *, init: str = "normal",
          std: float = 0.02) -> nnx.Param:
  """An fp32 parameter annotated with logical axes, its initialiser recorded, not applied.

  The value is a placeholder (zeros or ones); the initialiser is recorded in the metadata
  (`init`, `std`) and applied by `models.transformer.init` / `models.transformer.init_sharded`,
  so building a model costs no random-number compilation and one code path fills parameters
  on the host or directly sharded on a mesh.

  Args:
    shape: the parameter's shape.
    axes: one logical axis name per dimension (e.g. ("embed", "mlp")).
    init: "normal", "ones" or "zeros".
    std: standard deviation of "normal".

  Returns:
    The nnx.Param.
  """
  assert len(shape) == len(axes), (shape, axes)
  value = (jnp.ones if init == "ones" else jnp.zeros)(shape, jnp.float32)
  return nnx.Param(value, axes=axes, init=init, std=std)


def initial_value(var: nnx.Variable, key: jax.Array) -> jax.Array:
  """The initial value of a parameter made by `param`.

  Args:
    var: the variable (its metadata names the initialiser).
    key: PRNG key for "normal".

  Returns:
    normal(0, std), ones or zeros of the variable's shape.
  """
  meta = var.get_metadata()
  shape = var.shape
  if meta.get("init") == "normal":
    return meta["std"] * jax.random.normal(key, shape, jnp.float32)
  return (jnp.ones if meta.get("init") == "ones" else jnp.zeros)(shape, var.dtype)


def dtype_of(cfg: ModelConfig):
  """The compute dtype of `cfg` (parameters stay fp32)."""
  return jnp.dtype(cfg.dtype)


def round_to(x: jax.Array, dtype) -> jax.Array:
  """x cast to `dtype`, with a rounding XLA keeps wherever the program puts it.

  XLA may skip a narrowing cast inside a fusion (`xla_allow_excess_precision`, on by default)
  and fuses the decode step and the full forward pass differently, so a plain `astype` can
  round in one and not in the other: the engine and the trainer then compute different
  functions. `reduce_precision` is never skipped. A no-op for fp32.

  Args:
    x: any array.
    dtype: the target dtype.

  Returns:
    x in `dtype`, rounded to it.
  """
  y = x.astype(dtype)
  if jnp.finfo(y.dtype).bits >= 32:
    return y
  info = jnp.finfo(y.dtype)
  return jax.lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)


class RMSNorm(nnx.Module):
  """y = scale * x / sqrt(mean(x^2) + eps), computed in fp32 (as Hugging Face does).

  As in Hugging Face, the normalised x is rounded to x's dtype before the gain multiplies it;
  both roundings are kept by XLA (`round_to`), so a decode step and a full pass round alike.

  Args:
    dim: size of the normalised (last) axis.
    eps: added to the mean square.
    axes: logical axis of the gain.

  References:
    Zhang & Sennrich, "Root Mean Square Layer Normalization", arXiv:1910.07467.
  """

  def __init__(self, dim: int, eps: float, axes: tuple[str, ...] = ("norm",)):
    self.eps = eps
    self.scale = param((dim,), axes, init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return round_to(self.scale[...] * round_to(xf, x.dtype).astype(jnp.float32), x.dtype)


_PLAIN_DOT_GENERAL = jax.lax.dot_general
_PLAIN_DOT_GENERAL_CODE = jax.lax.dot_general.__code__


def _qwix_intercepting() -> bool:
  """Whether qwix has patched `jax.lax.dot_general` (while a LoRA or quantized model runs).

  qwix swaps the function, or its code object, for the duration of an intercepted call."""
  f = jax.lax.dot_general
  return f is not _PLAIN_DOT_GENERAL or f.__code__ is not _PLAIN_DOT_GENERAL_CODE


class Dense(nnx.Module):
  """A projection written as an einsum over named parameter dimensions.

  `kernel` has shape `in_shape + out_shape`; `bias` (optional) has shape `out_shape`.
  Example: the GQA query projection maps [.., embed] to [.., heads, head_dim] with
  `Dense((hidden,), (heads, head_dim), ("embed",), ("heads", "kv"))`.

  The matmul accumulates in fp32 and the bias is added in fp32; the sum is rounded once to the
  compute dtype (`round_to`). A bf16-output dot leaves its accumulation to the backend (on
  XLA:CPU its result depends on the number of rows, so one decode token and a full row of
  the same token differed); an fp32 accumulator is what TPUs and GPUs use anyway.

  Args:
    in_shape: the trailing input dimensions it contracts.
    out_shape: the output dimensions it produces.
    in_axes: logical axes of in_shape.
    out_axes: logical axes of out_shape.
    cfg: the model config (compute dtype, initialiser std).
    bias: add a bias of out_shape.
  """

  def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
               in_axes: tuple[str, ...], out_axes: tuple[str, ...], cfg: ModelConfig,
               bias: bool = False):
    self.n_in = len(in_shape)
    self.dtype = dtype_of(cfg)
    self.kernel = param(in_shape + out_shape, in_axes + out_axes, std=cfg.initializer_range)
    self.bias = param(out_shape, out_axes, init="zeros") if bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    # A kernel quantized by qwix (`models.lora.QuantizedKernel`, or qwix's own array while it
    # adapts the model) is passed on as it is, for qwix's dot_general to read.
    w = self.kernel
    w = w.get_value() if isinstance(w, nnx.Variable) else w
    w = w.astype(self.dtype) if isinstance(w, jax.Array) else w
    lead = x.shape[:x.ndim - self.n_in]
    x = x.astype(self.dtype)
    if isinstance(w, jax.Array) and not _qwix_intercepting():
      # One 2-D matmul [tokens, in] @ [in, out]: XLA:CPU runs its weight gradient x^T dy
      # without materialising a transposed copy of dy, which a dot_general with several free
      # kernel dimensions costs (measured: 11% of the demo model's training step).
      size_in = math.prod(w.shape[:self.n_in])
      y = jnp.dot(x.reshape(-1, size_in), w.reshape(size_in, -1),
                  preferred_element_type=jnp.float32).reshape(lead + w.shape[self.n_in:])
    else:
      # Under qwix the kernel is contracted as stored: qwix matches the operand to the
      # parameter by its shape (adapters, quantized kernels).
      contract = tuple(range(1, self.n_in + 1)), tuple(range(self.n_in))
      y = jax.lax.dot_general(x.reshape((-1,) + x.shape[x.ndim - self.n_in:]), w,
                              (contract, ((), ())), preferred_element_type=jnp.float32)
      y = y.reshape(lead + y.shape[1:])
    if self.bias is not None:
      y = y + self.bias[...]
    return round_to(y, self.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)).

  Args:
    hidden: model width.
    width: intermediate width.
    cfg: the model config.

  References:
    Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202.
  """

  def __init__(self, hidden: int, width: int, cfg: ModelConfig):
    self.cfg = cfg
    self.gate_proj = Dense((hidden,), (width,), ("embed",), ("mlp",), cfg)
    self.up_proj = Dense((hidden,), (width,), ("embed",), ("mlp",), cfg)
    self.down_proj = Dense((width,), (hidden,), ("mlp",), ("embed",), cfg)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    h = constrain(h, ("batch", "seq", "act_mlp"), self.cfg)
    return self.down_proj(h)
