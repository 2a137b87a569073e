"""RMSNorm backward kernel (O11).

`rms_norm_bwd`: load h, dy (and dh_out) once; both row sums, of h² and of
g·h, come from the same registers, so r is recomputed instead of saved.
dgamma is accumulated per block in registers over all its tiles, written
once as a partial, and summed by one small XLA reduction (two stages, no
atomics); the rows of a ragged last tile past `t` are masked out of it.
The technique, the tiling and the shapes' legend are in `mosaic_gpu.py`.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rms_norm.mosaic_gpu import _Config
from pallas_kernels.rms_norm.mosaic_gpu_pipeline import (
  bcast_cols,
  bcast_rows,
  launch,
  load_gamma,
  pipeline,
  prologue,
)


def _bwd_kernel(cfg: _Config, *refs):
  it = iter(refs)
  h_gmem, dy_gmem = next(it), next(it)
  dh_out_gmem = next(it) if cfg.has_residual else None
  gamma_gmem = next(it) if cfg.gamma_dtype else None
  dh_gmem = next(it)
  dgamma_gmem = next(it) if cfg.gamma_dtype else None
  in_smem, out_smem, barrier = next(it), next(it), next(it)
  acc_smem = next(it) if cfg.gamma_dtype else None
  in_gmem = [h_gmem, dy_gmem] + ([dh_out_gmem] if cfg.has_residual else [])
  layout = cfg.layout
  m, d = cfg.block_rows, cfg.d
  prologue(cfg)
  gamma = load_gamma(gamma_gmem, cfg) if cfg.gamma_dtype else None
  inv_d = 1.0 / d

  def body(row0, load, store, acc):
    h = load(0).astype(jnp.float32)
    dy = load(1).astype(jnp.float32)
    g = dy if gamma is None else dy * bcast_cols(gamma, cfg)
    r_m = lax.rsqrt(jnp.sum(h * h, axis=1) * inv_d + cfg.eps)
    c_m = r_m * r_m * r_m * (jnp.sum(g * h, axis=1) * inv_d)
    dh = g * bcast_rows(r_m, cfg) - h * bcast_rows(c_m, cfg)
    if cfg.has_residual:
      dh = dh + load(2).astype(jnp.float32)
    store([dh])
    if gamma is None:
      return acc
    contrib = dy * h * bcast_rows(r_m, cfg)
    if cfg.ragged:
      # Rows past `t` in the last tile hold stale shared memory.
      row = plgpu.broadcasted_iota(jnp.int32, (m, d), 0, layout=layout)
      contrib = jnp.where(row + row0 < cfg.t, contrib, 0.0)
    return acc + contrib

  run = pipeline(cfg, in_gmem, in_smem, barrier, [dh_gmem], out_smem)
  if gamma is None:
    run(body, ())
    return
  acc0 = plgpu.layout_cast(jnp.zeros((m, d), jnp.float32), layout)
  acc = run(body, acc0)
  acc_smem[...] = acc
  plgpu.commit_smem()
  blk = lax.axis_index("blocks")
  plgpu.copy_smem_to_gmem(acc_smem, dgamma_gmem.at[pl.ds(blk * m, m)])
  plgpu.wait_smem_to_gmem(0)


def rms_norm_bwd(h_td, dy_td, dh_out_td, gamma_d, cfg: _Config):
  """Returns `dh` (`[t, d]`, x's dtype) and `dgamma` (`[d]` f32 or None)."""
  t, d = h_td.shape
  m = cfg.block_rows
  out_type = [jax.ShapeDtypeStruct((t, d), h_td.dtype)]
  extra = []
  if cfg.gamma_dtype:
    out_type.append(jax.ShapeDtypeStruct((cfg.num_blocks * m, d), jnp.float32))
    extra.append(plgpu.SMEM((m, d), jnp.float32))
  args = [h_td, dy_td]
  if cfg.has_residual:
    args.append(dh_out_td)
  if cfg.gamma_dtype:
    args.append(gamma_d)
  n_in = 2 + cfg.has_residual
  outs = launch(_bwd_kernel, cfg, out_type, n_in, 1, extra, *args)
  dh = outs[0]
  # Second stage of the dgamma reduction: `[g·m, d]` partials -> `[d]`.
  dgamma = jnp.sum(outs[1], axis=0) if cfg.gamma_dtype else None
  return dh, dgamma
