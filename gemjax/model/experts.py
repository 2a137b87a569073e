"""A DHEN-style stack of heterogeneous experts over candidate features (G6).

DHEN (Deep and Hierarchical Ensemble Network) stacks layers whose modules
are different kinds of interaction experts, run side by side on the same
input and combined. Here each layer has two experts on `x [..., D]`:

  MLP expert:    y0 = gelu(x W1 + b1) W2 + b2     (W1 [D, 2D], W2 [2D, D])
  cross expert:  y1 = x * (x Wc + bc)              (DCN-v2 cross, Wc [D, D])
  layer:         x <- rmsnorm(x + y0 + y1)

In the ranking model the stack sits between the candidate features and the
task heads, when `ModelConfig.dhen_layers > 0`.

Placement. Each layer keeps its experts' tensors packed in one flat
parameter `[E, L]` (logical axes `experts`, `expert_params`; expert `e`'s
tensors in row `e`, zero-padded to a common `L`), so `sharding` can give
each GPU of a node pair one expert, FSDP-sharded over `zone`, and exchange
activations inside the node (`sharding.experts`). The layer only asks for
"the outputs of every expert on x" through `run(w_el, x, fns)`; without a
runner every expert runs locally, with the same numbers. The price of the
flat layout is padding: the cross expert's row carries the MLP expert's
size.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.model.layers import TRUNC_NORMAL, RMSNorm, matmul

PAD = 512  # L is a multiple of this, so up to 512-way FSDP divides it


class FlatSpec:
  """Named tensor shapes packed one after the other into a flat vector."""

  def __init__(self, shapes: dict[str, tuple[int, ...]]):
    self.shapes = dict(shapes)
    self.size = sum(math.prod(s) for s in self.shapes.values())

  def unpack(self, w_l) -> dict:
    out, at = {}, 0
    for name, shape in self.shapes.items():
      n = math.prod(shape)
      out[name] = w_l[at : at + n].reshape(shape)
      at += n
    return out

  def init(self, key, length: int):
    """Weights TruncatedNormal(0.02) (O5), biases zero, zero padding."""
    parts = []
    for name, shape in self.shapes.items():
      key, sub = jax.random.split(key)
      if name.startswith("b"):
        parts.append(jnp.zeros(math.prod(shape), jnp.float32))
      else:
        parts.append(TRUNC_NORMAL(sub, shape, jnp.float32).reshape(-1))
    flat = jnp.concatenate(parts)
    return jnp.pad(flat, (0, length - flat.shape[0]))


class DHENLayer(nnx.Module):
  def __init__(self, d: int, *, rngs: nnx.Rngs, dtype):
    h = 2 * d
    self.specs = (
      FlatSpec({"w1": (d, h), "b1": (h,), "w2": (h, d), "b2": (d,)}),
      FlatSpec({"wc": (d, d), "bc": (d,)}),
    )
    length = -(-max(s.size for s in self.specs) // PAD) * PAD
    w = jnp.stack([s.init(rngs.params(), length) for s in self.specs])
    self.w = nnx.Param(w, logical_axes=("experts", "expert_params"))
    self.norm = RMSNorm(d, "dhen")
    self.dtype = dtype

  def fns(self):
    return (self._mlp, self._cross)

  def _mlp(self, w_l, x):
    p = self.specs[0].unpack(w_l.astype(self.dtype))
    x = x.astype(self.dtype)
    hid = jax.nn.gelu(matmul(x, p["w1"], x.dtype) + p["b1"])
    return (matmul(hid, p["w2"], x.dtype) + p["b2"]).astype(x.dtype)

  def _cross(self, w_l, x):
    p = self.specs[1].unpack(w_l.astype(self.dtype))
    x = x.astype(self.dtype)
    return (x * (matmul(x, p["wc"], x.dtype) + p["bc"])).astype(x.dtype)

  def __call__(self, x, run=None):
    w = self.w[...]
    if run is None:
      ys = [f(w[e], x) for e, f in enumerate(self.fns())]
    else:
      ys = run(w, x, self.fns())
    return self.norm(x + sum(ys))


class DHEN(nnx.Module):
  def __init__(self, d: int, num_layers: int, *, rngs: nnx.Rngs, dtype):
    self.layers = nnx.List(
      [DHENLayer(d, rngs=rngs, dtype=dtype) for _ in range(num_layers)]
    )

  def __call__(self, x, run=None):
    """`x [..., D]` -> `[..., D]`; `run` spreads experts over devices."""
    for layer in self.layers:
      x = layer(x, run)
    return x
