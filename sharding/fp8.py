"""FP8 weights under FSDP: quantize the local shard, all-gather 8 bits (G4).

Under FSDP (G5) a dense weight lives sharded over the group's devices and is
all-gathered before its layer runs. For a layer that computes in FP8 the
gather can move the quantized weight instead: every device quantizes its own
shard (e4m3 values and power-of-two block scales, `pallas_kernels.fp8`) and
the group all-gathers values and scales, 1 byte per element plus one f32
scale per block instead of 2 (bf16) or 4 (f32) bytes per element. No device
quantizes the full weight.

Blocks must not straddle shards: along every sharded dimension, the shard
size must be a multiple of the weight block along it (and of the Hadamard
block along the contraction axis). Then each device's blocks are blocks of
the full weight, and the gathered tensor is bit-identical to quantizing the
full weight. Example: `w [d_in, d_out]` quantized along `d_in` in 128x128
("deepseek") or 32x32 ("mxfp8") blocks, FSDP over 8 devices on `embed`
(`d_in` for Q/K/V and the FFN's gate/up, `d_out` for O and down): d_model
1024 (deepseek) or 256 (mxfp8) and up qualify. Otherwise the full weight
is quantized: the hook declines (returns None) and the layer quantizes it,
or, inside `Placement.per_shard` where the layer holds only its shard, the
hook gathers the weight in its own precision and quantizes that.

Shapes: `w_io` a weight `[d_in, d_out]`; values are stored with the
contraction axis last, `v_oi [d_out, d_in]`, scales `s [d_out/br, d_in/bc]`.

The model never names a mesh axis: `QuantizedGather(mesh, strategy)` is a
callable `hook(w, logical_axes, quantize) -> Fp8Tensor | None` that the
model's FP8 layers call when it is installed (`gemjax.model.layers.
fp8_weight_hook`); it finds the shard layout from the logical axes through
the strategy's rule table, exactly as the parameters were placed.

Gradients: the returned tensor's `source` is the sharded weight itself, only
read by the backward (`fp8_dot_general` routes the weight gradient to it),
so XLA's partitioner reduces the gradient onto the shards as for any FSDP
weight (XLA:CPU: an f32 all-reduce, then each device keeps its slice; the
same as for a BF16/F32 weight), and nothing ever gathers the
high-precision weight.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from sharding import rules


@dataclasses.dataclass(frozen=True)
class QuantizedGather:
  """The FP8 weight hook for FSDP: quantize the local shard, gather 8 bits."""

  mesh: Mesh
  strategy: str = "fsdp"
  # Inside `Placement.per_shard` (every mesh axis manual): `w` is already the
  # local shard, and the gathers run as plain collectives.
  manual: bool = False

  def spec(self, logical_axes, shape) -> PartitionSpec:
    return rules.logical_to_spec(logical_axes, shape, self.mesh, self.strategy)

  def __call__(self, w, logical_axes, quantize):
    """`quantize(w_part) -> Fp8Tensor` is the layer's own quantizer."""
    if w.ndim != 2:
      return None
    spec = tuple(self.spec(logical_axes, w.shape))
    spec = spec + (None,) * (w.ndim - len(spec))
    if all(s is None for s in spec):
      return None  # replicated: nothing to gather
    if self.manual:
      local = tuple(w.shape)
      full = tuple(n * self._size(s) for n, s in zip(local, spec, strict=True))
    else:
      full = tuple(w.shape)
      local = tuple(n // self._size(s) for n, s in zip(full, spec, strict=True))
    meta = jax.eval_shape(quantize, jax.ShapeDtypeStruct(local, w.dtype))
    axis, (br, bc) = meta.axis, meta.block
    other = 1 - axis
    # Blocks per dimension of `w`: `bc` along the contraction axis, `br`
    # along the other (rows of the values' matrix view).
    need = {axis: math.lcm(bc, meta.hadamard or 1), other: br}
    if any(s is not None and local[d] % need[d] for d, s in enumerate(spec)):
      # A block would straddle two shards: the full weight is quantized,
      # by the layer (XLA gathers it), or here where `w` is this device's
      # shard (manual): gathered in its own precision, its gradient
      # reduce-scattered back by the gather's transpose.
      if not self.manual:
        return None
      for d, s in enumerate(spec):
        if s is not None:
          w = lax.all_gather(w, s, axis=d, tiled=True)
      return quantize(w)
    # Values and scales are `[other, axis]`: value dim 0 is w's `other`.
    gathers = [(0, spec[other]), (1, spec[axis])]

    def body(w_local):
      t = quantize(w_local)
      # The e4m3 bits travel as uint8: XLA:CPU widens f8 collectives to f16
      # (2 bytes); a uint8 all-gather moves 1 byte on every backend.
      v = lax.bitcast_convert_type(t.values, jnp.uint8)
      s = t.scales
      for dim, axes in gathers:
        if axes is not None:
          v = lax.all_gather(v, axes, axis=dim, tiled=True)
          s = lax.all_gather(s, axes, axis=dim, tiled=True)
      return lax.bitcast_convert_type(v, t.values.dtype), s

    if self.manual:
      v, s = body(w)
      source = grad_anchor(w, spec, full)
    else:
      v, s = jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(PartitionSpec(*spec),),
        out_specs=(PartitionSpec(), PartitionSpec()),
        check_vma=False,
      )(w)
      source = w
    return dataclasses.replace(
      meta, values=v, scales=s, source=source, shape=full
    )

  def _size(self, axes) -> int:
    if axes is None:
      return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(self.mesh.shape[a] for a in axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def grad_anchor(w_local, spec, full):
  """A full-shape (`full`) stand-in for a weight gathered in 8 bits, under
  manual axes: never read (zeros), its gradient goes back to the local shard
  by a reduce-scatter along every sharded dimension (the transpose of the
  gather the high-precision weight never took)."""
  del spec
  return jnp.zeros(full, w_local.dtype)


def _anchor_fwd(w_local, spec, full):
  return grad_anchor(w_local, spec, full), None


def _anchor_bwd(spec, full, _, g):
  for dim, axes in enumerate(spec):
    if axes is not None:
      g = lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
  return (g,)


grad_anchor.defvjp(_anchor_fwd, _anchor_bwd)
