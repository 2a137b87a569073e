"""The kernels follow the GPU they run on.

The Mosaic GPU kernels are written for Hopper: on another GPU the ops'
default is the XLA reference (`dispatch.hopper`). Each persistent kernel
launches about one CTA per SM and deals its work list over them. The SM
count comes from the device (`mosaic.num_sms`): a fixed 132 (H100 / H200
SXM) on a Hopper with fewer SMs would leave the CTAs past the SM count to a
second wave. Off-GPU (interpret mode, lowering for CUDA on this host) it is
132. A fake GPU device stands in for one here.
"""

import dataclasses

import jax
import jax._src.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import dispatch, mosaic, schedule
from pallas_kernels.fp8 import mosaic_gpu_matmul
from pallas_kernels.jagged_attention import mosaic_gpu as jagged_mg
from pallas_kernels.jagged_attention.op import (
  jagged_attention_mosaic as jagged_attention,
)
from pallas_kernels.rms_norm import mosaic_gpu as rms_mg


@dataclasses.dataclass
class _FakeGpu:
  core_count: int
  compute_capability: str = "9.0"
  platform: str = "gpu"


def _on(monkeypatch, device):
  """This process's first device is `device`, its backend the GPU's."""
  monkeypatch.setattr(jax, "local_devices", lambda: [device])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.fixture
def h20(monkeypatch):
  """A 78-SM Hopper (an H20)."""
  _on(monkeypatch, _FakeGpu(78))
  return 78


@pytest.mark.parametrize(
  "capability,want", [("9.0", "mosaic"), ("8.0", "xla"), ("10.0", "xla")]
)
def test_default_is_mosaic_only_on_hopper(monkeypatch, capability, want):
  impls = {"xla": object(), "mosaic": object()}
  _on(monkeypatch, _FakeGpu(108, capability))  # e.g. an A100: 8.0
  assert dispatch.pick("op", impls, None, "mosaic") is impls[want]
  assert dispatch.pick("op", impls, "xla", "mosaic") is impls["xla"]
  if want == "mosaic":
    assert dispatch.pick("op", impls, "mosaic", "mosaic") is impls["mosaic"]
  else:  # asking for the kernels there: a clear error, not a compile one
    with pytest.raises(ValueError, match=f"Hopper.*is {capability}"):
      dispatch.pick("op", impls, "mosaic", "mosaic")
  # The public ops run on such a GPU by default (here: the reference; V
  # all ones, so every output row is ones).
  if want == "xla":
    x = jnp.ones((4, 2, 64), jnp.bfloat16)
    out = pallas_kernels.jagged_attention(
      x, x[:, :1], x[:, :1], jnp.array([0, 4], jnp.int32)
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)


def test_sm_count_of_this_device():
  dev = jax.local_devices()[0]
  on_gpu = dev.platform == "gpu"
  assert mosaic.num_sms() == (dev.core_count if on_gpu else 132)
  assert mosaic.num_sms(5) == 5


def test_persistent_grids_follow_the_gpu(h20):
  assert mosaic.num_sms() == h20
  assert mosaic.num_sms(3) == 3  # a caller's count wins

  # Jagged attention: 8 query heads over 2 KV heads, CTAs per KV head.
  q_off = jnp.array([0, 1500, 1600, 4000], jnp.int32)
  items, _ = schedule.query_items(
    q_off, q_off, 4096, block_q=64, block_kv=128, causal=False
  )
  bs = jagged_mg.BlockSizes()
  workers, _, counts = schedule.deal_items(items, 2, True, bs.num_sms)
  assert workers == h20 // 2
  real = items[:, schedule.QueryItem.HI] > items[:, schedule.QueryItem.LO]
  assert int(counts.sum()) == int(real.sum())
  workers, *_ = schedule.deal_items(items, 2, True, 132)
  assert workers == 66

  # RMSNorm: one block per SM (two with the wide-row loads).
  def blocks(d):
    cfg = rms_mg.make_config(
      262_144, d, jnp.bfloat16, None, True, 1e-6, None, False, bwd=False
    )
    return cfg.num_blocks

  assert (blocks(512), blocks(2048)) == (h20, 2 * h20)

  # FP8 split-K: a 64-tile weight gradient fills 78 SMs without a split
  # (it took 2 runs on 132).
  bs8 = mosaic_gpu_matmul.BlockSizes()
  assert mosaic_gpu_matmul.k_splits(2048, 512, 65_536, bs8) == 1
  assert mosaic_gpu_matmul.k_splits(2048, 512, 65_536, bs8, num_sms=132) == 2


def test_profiling_reaches_compiled_kernels_only(monkeypatch, tmp_path):
  """`mosaic.profiling` gives every kernel built by `warp_specialized`
  meanwhile the Mosaic GPU profiler, its traces in a folder per kernel;
  kernels built outside it, or in interpret mode (no profiler), get
  none."""
  built = []

  def kernel(body, *, compiler_params, **kw):
    built.append(compiler_params)
    return body

  monkeypatch.setattr(mosaic.plgpu, "kernel", kernel)

  def build(interpret=None, **kw):
    args = dict(out_type=(), scratch=(), grid=(1, 1), consumers=2)
    return mosaic.warp_specialized(
      lambda: None, interpret=interpret, **args, **kw
    )

  build()
  with mosaic.profiling(tmp_path, regions=32):
    build(name="dkv")
    build(interpret=object(), name="forward")
  build()
  spaces = [(p.profile_space, p.profile_dir) for p in built]
  assert spaces == [(0, ""), (32, str(tmp_path / "dkv")), (0, ""), (0, "")]
  assert all(p.approx_math for p in built)
  assert [d.name for d in tmp_path.iterdir()] == ["dkv"]


def test_jagged_kernels_mark_their_work_items():
  """What `mosaic.profiling` records: each jagged attention kernel marks
  its work items as "item" regions (`jax.named_call`); the small delta
  kernel has no items."""

  def marks_items(jaxpr):
    return any(
      "item" in str(e.source_info.name_stack)
      or any(marks_items(s) for s in jax_core.jaxprs_in_params(e.params))
      for e in jaxpr.eqns
    )

  def kernels(jaxpr):  # `plgpu.kernel` stages out as `mpmd_map`
    for e in jaxpr.eqns:
      subs = jax_core.jaxprs_in_params(e.params)
      if e.primitive.name == "mpmd_map":
        yield any(marks_items(s) for s in subs)
      for s in subs:
        yield from kernels(s)

  off = jnp.array([0, 70, 80], jnp.int32)
  for h, want in ((64, [True, False, True]), (128, [True, True, True])):
    # D64: forward, delta, fused dK/dV/dQ; D128: forward, dQ, dK/dV.
    q, kv = jnp.ones((80, 2, h), jnp.bfloat16), jnp.ones((80, 1, h))
    loss = lambda q, k, v: jagged_attention(q, k, v, off, off).sum()  # noqa: E731
    grads = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))
    jaxpr = grads(q, kv.astype(q.dtype), kv.astype(q.dtype)).jaxpr
    assert list(kernels(jaxpr)) == want, h
