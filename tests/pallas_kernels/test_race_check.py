"""The race check the attention tests rely on (`attention_cases.races`)
does see a race: it counts the detector's printed reports, so a change in
how the interpreter reports would otherwise pass every kernel silently."""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tests.pallas_kernels import attention_cases as cases


def _racy(x):
  """Two warpgroups write one shared buffer with no barrier between."""

  def kernel(x_ref, o_ref, smem):
    wg = lax.axis_index("wg")
    smem[...] = x_ref[...] + wg.astype(jnp.float32)

    @pl.when(wg == 0)
    def _():
      o_ref[...] = smem[...]

  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[plgpu.SMEM(x.shape, x.dtype)],
    num_threads=2,
    thread_name="wg",
    interpret=cases.RACE_PARAMS,
  )(x)


def test_race_check_reports_a_race():
  n, log = cases.races(_racy, jnp.ones((128,), jnp.float32))
  assert n > 0, log[:2000]
