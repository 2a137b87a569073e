"""Every Mosaic GPU kernel lowers for CUDA at the shapes we benchmark.

The interpret-mode tests check what the kernels compute, but not that
Pallas can lower them to Mosaic GPU: layouts, TMA transforms, wgmma operand
shapes and shared-memory budgets are only checked by the real lowering. JAX
can lower for a platform it is not running on (`jax.export` with
`platforms=["cuda"]`), so CI on CPU catches a kernel that would not build on
the H200, forward and backward, without a GPU. Only abstract shapes are
used: nothing is allocated. What is left to the GPU is PTX generation and
running the kernel (the `-m gpu` tests).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels.block_attention.op import block_attention_mosaic
from pallas_kernels.fp8 import (
  mosaic_gpu_matmul,
  mosaic_gpu_quantize,
  mosaic_gpu_quantizing_matmul,
  mosaic_gpu_transpose_quantize,
)
from pallas_kernels.gdpa import mosaic_gpu as gdpa_mg
from pallas_kernels.gdpa import mosaic_gpu_bwd_dq as gdpa_bwd_dq
from pallas_kernels.gdpa.op import gdpa_mosaic
from pallas_kernels.jagged_attention.op import jagged_attention_mosaic
from pallas_kernels.rms_norm.op import rms_norm_mosaic

B, L, N, KH = 32, 2048, 8, 2  # the benchmarks' batch: 32 x 2,048, 8/2 heads
BF16 = jnp.bfloat16


def _spec(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


OFFSETS = _spec((B + 1,), jnp.int32)


def _lowers_for_cuda(fn, *args, kernels: int):
  """`fn` lowers for CUDA with exactly `kernels` Mosaic GPU kernels in it
  (a part that fell back to XLA would lower too, with fewer)."""
  exported = export.export(jax.jit(fn), platforms=["cuda"])(*args)
  found = exported.mlir_module().count("custom_call @mosaic_gpu")
  assert found == kernels, f"{found} Mosaic GPU kernels, want {kernels}"


def _with_grads(f):
  """`f`'s output and the gradients of its three attention operands."""

  def fwd_bwd(q, k, v, *rest):
    loss = lambda q, k, v: f(q, k, v, *rest).astype(jnp.float32).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  return fwd_bwd


@pytest.mark.parametrize("h", [128, 64])
@pytest.mark.parametrize("case", ["self", "causal", "cross", "window"])
def test_jagged_attention(case, h):
  q = _spec((B * L, N, h))
  kv_rows = B * 256 if case == "cross" else B * L
  k = _spec((kv_rows, KH, h))
  window = 64 if case == "window" else None
  f = lambda q, k, v, qo, ko: jagged_attention_mosaic(
    q, k, v, qo, ko, causal=case == "causal", window=window, interpret=False
  )  # forward, dQ, dK/dV
  _lowers_for_cuda(_with_grads(f), q, k, k, OFFSETS, OFFSETS, kernels=3)


def test_layers_share_their_kernels():
  """The same op in several layers (equal shapes and settings) lowers its
  kernels once (`mosaic.trace_once`): three chained causal attentions and
  RMSNorms, differentiated, hold one forward, dQ and dK/dV kernel and one
  RMSNorm forward and backward, where each call used to lower its own."""
  h = 64
  q = _spec((4096, N, h))

  def layers(q, k, v, qo, ko):
    for _ in range(3):
      o = jagged_attention_mosaic(q, k, v, qo, causal=True, interpret=False)
      q = rms_norm_mosaic(o.reshape(-1, h), interpret=False).reshape(q.shape)
    return q

  _lowers_for_cuda(
    _with_grads(layers), q, _spec((4096, KH, h)), _spec((4096, KH, h)),
    OFFSETS, OFFSETS, kernels=5,
  )  # fmt: skip


@pytest.mark.parametrize(
  "shape", ["cross16", "cross256", "pooled", "self_gelu", "self_silu_norm"]
)
def test_gdpa(shape):
  h = 128
  kw = dict(activation="gelu_tanh")
  if shape.startswith("cross"):
    q_rows, kv_rows = B * L, B * int(shape[5:])
    kw["max_len_kv"] = int(shape[5:])  # cross16: 16-row key tiles
  elif shape == "pooled":
    q_rows, kv_rows = B * 16, B * L
  else:
    q_rows = kv_rows = 4096
    kw = dict(activation="gelu")
    if shape == "self_silu_norm":
      kw = dict(activation="silu", normalize="hstu")
  q, k = _spec((q_rows, N, h)), _spec((kv_rows, KH, h))
  f = lambda q, k, v, qo, ko: gdpa_mosaic(
    q, k, v, qo, ko, interpret=False, **kw
  )  # forward and dK/dV, which adds dQ (longer keys) or writes dS^T for
  # a dQ pass (short keys, `dq_path`)
  kernels = 3 if shape.startswith("cross") else 2
  _lowers_for_cuda(_with_grads(f), q, k, k, OFFSETS, OFFSETS, kernels=kernels)


def test_gdpa_dq_from_ds_deep_ring():
  """`kv_stages=4` asks for a 6-slot dS^T ring in the dQ-from-dS^T kernel,
  which does not fit beside its f32 split-K output buffers at head dim
  128 (262,240 B): the kernel takes the deepest ring that fits instead of
  failing in Mosaic's compile."""
  q, k = _spec((B * L, N, 128)), _spec((B * 256, KH, 128))
  bs = gdpa_mg.BlockSizes(kv_stages=4)
  assert gdpa_bwd_dq._ds_ring(bs, 2, 128, 4) == 5
  f = lambda q, k, v, qo, ko: gdpa_mosaic(
    q, k, v, qo, ko, activation="gelu_tanh", max_len_kv=256,
    block_sizes=bs, interpret=False,
  )  # fmt: skip
  _lowers_for_cuda(_with_grads(f), q, k, k, OFFSETS, OFFSETS, kernels=3)


@pytest.mark.parametrize("h", [128, 64])
@pytest.mark.parametrize("kv", [16, 256])
def test_gdpa_fused_dq(kv, h):
  """dQ added by the dK/dV kernel (TMA reduce-add; interpret mode stores
  instead): the forward and the fused backward, two kernels."""
  q, k = _spec((B * L, N, h)), _spec((B * kv, KH, h))
  bs = gdpa_mg.BlockSizes(dq_fused=True)
  f = lambda q, k, v, qo, ko: gdpa_mosaic(
    q, k, v, qo, ko, activation="gelu_tanh", max_len_kv=kv,
    block_sizes=bs, interpret=False,
  )  # fmt: skip
  _lowers_for_cuda(_with_grads(f), q, k, k, OFFSETS, OFFSETS, kernels=2)


@pytest.mark.parametrize("h", [128, 64])
@pytest.mark.parametrize("block,rope", [(64, 1e4), (64, None), (32, 1e4)])
def test_block_attention(block, rope, h):
  q, k = _spec((B * L, N, h)), _spec((B * L, KH, h))
  f = lambda q, k, v, o: block_attention_mosaic(
    q, k, v, o, block=block, rope=rope, max_len=L, interpret=False
  )  # forward, backward
  _lowers_for_cuda(_with_grads(f), q, k, k, OFFSETS, kernels=2)


# 8192 bf16 and 4096 f32 take fewer output slots (they were over 227 KiB).
@pytest.mark.parametrize("d,dtype", [(512, BF16), (2048, BF16), (8192, BF16),
                                     (4096, jnp.float32)])  # fmt: skip
def test_rms_norm_with_residual(d, dtype):
  x, g = _spec((B * L, d), dtype), _spec((d,), dtype)

  def fwd_bwd(x, g, r):
    def loss(x, g, r):
      y, r2 = rms_norm_mosaic(x, g, r, interpret=False)
      return (y.astype(jnp.float32) ** 2).sum() + r2.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))(x, g, r)

  _lowers_for_cuda(fwd_bwd, x, g, x, kernels=2)  # forward, backward


# The fused FP8 output's block layout: 2 warps per row at 4096; scales
# leaving transposed at 128 and 256 (`_Config.scales_transposed`).
@pytest.mark.parametrize("d", [128, 256, 512, 2048, 4096])
def test_rms_norm_fp8_output(d):
  x, g = _spec((B * L, d)), _spec((d,))
  f = lambda x, g, r: rms_norm_mosaic(
    x, g, r, quantize="deepseek", interpret=False
  )
  _lowers_for_cuda(f, x, g, x, kernels=1)


@pytest.mark.parametrize(
  "block,hadamard", [((32, 32), 32), ((1, 128), None), ((1, 128), 128)]
)
def test_fp8_quantize(block, hadamard):
  f = lambda x: mosaic_gpu_quantize.quantize_mgpu(
    x, block=block, hadamard=hadamard, interpret=False
  )
  _lowers_for_cuda(f, _spec((16384, 4096)), kernels=1)


@pytest.mark.parametrize("form", ["bf16", "bf16 rows_too", "e4m3"])
@pytest.mark.parametrize("r,c", [(16384, 4096), (65536, 512)])
def test_fp8_transpose_quantize(r, c, form):
  """`x^T` quantized from bf16 `x` (one warpgroup; with `x` along its rows
  in the same pass, as the FP8 backward quantizes g, two compute
  warpgroups), or requantized from e4m3 values and their scales (the FP8
  weight gradient's operands)."""
  scaled = form == "e4m3"
  x = _spec((r, c), jnp.float8_e4m3fn if scaled else BF16)
  sx = _spec((c // 128, r), jnp.float32) if scaled else None
  f = lambda x, sx: mosaic_gpu_transpose_quantize.transpose_quantize_mgpu(
    x, sx, rows_too=form == "bf16 rows_too"
  )
  _lowers_for_cuda(f, x, sx, kernels=1)


@pytest.mark.parametrize("m,k,n", [(16384, 4096, 4096), (65536, 512, 2048)])
@pytest.mark.parametrize("op_default", [False, True])
@pytest.mark.parametrize("kb", [32, 128])
def test_fp8_matmul(kb, op_default, m, k, n):
  """Plain tiles and the op's default (at kb=128 a 2-CTA cluster); at the
  short k the per-tile pipelines are chained."""
  bs = mosaic_gpu_matmul.BlockSizes()
  if op_default:
    bs = mosaic_gpu_matmul.default_block_sizes(kb)
  _fp8_matmul_lowers(m, k, n, kb, bs)


def _fp8_matmul_lowers(m, k, n, kb, bs, splits=1):
  f8 = jnp.float8_e4m3fn
  f = lambda a, sa, b, sb: mosaic_gpu_matmul.scaled_matmul_mgpu(
    a, sa, b, sb, kb=kb, block_sizes=bs, splits=splits, interpret=False
  )
  _lowers_for_cuda(
    f,
    _spec((m, k), f8),
    _spec((k // kb, m), jnp.float32),
    _spec((n, k), f8),
    _spec((k // kb, n), jnp.float32),
    kernels=1,
  )


@pytest.mark.parametrize("m,n", [(512, 2048), (2048, 512)])
def test_fp8_matmul_split_k(m, n):
  """The FP8 weight gradients of the narrow benchmark shapes (65,536
  tokens): split-K with f32 partial tiles, in the tile and runs the op
  takes (per-row scales on both sides)."""
  k, kb = 65536, 128
  bs, splits = mosaic_gpu_matmul.split_k_plan(m, n, k, kb, uniform=False)
  assert splits == 2
  _fp8_matmul_lowers(m, k, n, kb, bs, splits)


@pytest.mark.parametrize("cluster_m", [1, 2, 4])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("m,k,n", [(65536, 2048, 512), (16384, 4096, 4096)])
def test_fp8_quantizing_matmul(m, k, n, uniform, cluster_m):
  """`a` quantized in the GEMM (two quantizer warpgroups, setmaxnreg),
  alone or in clusters multicasting the weight tiles."""
  bs = mosaic_gpu_quantizing_matmul.QuantizingBlockSizes(cluster_m=cluster_m)
  f = lambda a, b, sb: mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(
    a, b, sb, block_sizes=bs, b_scale_uniform=uniform, interpret=False
  )
  _lowers_for_cuda(
    f,
    _spec((m, k)),
    _spec((n, k), jnp.float8_e4m3fn),
    _spec((k // 128, n), jnp.float32),
    kernels=1,
  )


def test_fp8_quantizing_matmul_f32_output_with_one_stage():
  """`quantizing_fits` says one bf16 stage per quantizer leaves room for
  an f32 epilogue (the default two do not): it lowers."""
  bs = mosaic_gpu_quantizing_matmul.QuantizingBlockSizes(stages_a=1)
  assert mosaic_gpu_quantizing_matmul.quantizing_fits(jnp.float32, bs)
  f = lambda a, b, sb: mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu(
    a, b, sb, block_sizes=bs, out_dtype=jnp.float32, interpret=False
  )
  _lowers_for_cuda(
    f,
    _spec((65536, 2048)),
    _spec((512, 2048), jnp.float8_e4m3fn),
    _spec((16, 512), jnp.float32),
    kernels=1,
  )
