"""FP8 block-scaled matmul (G4) against cuBLAS bf16 and XLA fp8, on one GPU.

Run on the H200 from the repository root:

  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/fp8_matmul.py [--out DIR]

For M x K x N in {16384x4096x4096, 65536x2048x512, 65536x512x2048}:

  forward   y = x w, x `[M, K]` bf16 activations quantized inside the timed
            function (by the GEMM kernel itself where N <= 512, else by a
            quantize pass first: both forms are rows), w `[K, N]`
            quantized once beforehand (once per step)
  backward  dx, dw from dy `[M, N]`: the timed function is `jax.vjp`'s pull-
            back applied to residuals a forward run saved beforehand, as a
            training step's backward runs (`_pullback`; ours keeps x
            quantized by the forward, whose figure already counts it)

Baselines in the same process: bf16 `jnp.dot` (cuBLAS), XLA fp8 with a plain
cast of x, XLA fp8 with a per-tensor scale (amax, scale, cast in XLA), and
XLA fp8 on inputs already in fp8 (the GEMM alone, an upper bound; for the
backward, `_bwd_bound`: cuBLAS fp8 for dX, and for dW too or not). Also the
kernels alone (matmul on quantized inputs; quantize with and without
Hadamard, as a fraction of the copy bandwidth measured here).
`--qgemm-sweep`: the GEMM that quantizes bf16 x itself, per configuration
(clusters multicasting the weight tiles), against quantize pass + GEMM.
`--norm-dense`: RMSNorm (residual add, gain) feeding the dense layer, as the
model's blocks run it (`bench_norm_dense`): there the activation is quantized
by the norm kernel, so the FP8 GEMM reads 8-bit input with no pass of its own.
`--parts`: where the time goes, per shape: each kernel's device time per call
in our forward and backwards and in cuBLAS bf16's, from a profiler trace
(`parts`; results in `fp8_matmul_parts.json`).

Timing: a measurement is `common.device_time` over back-to-back calls (inputs
rotated between two sets), so launch gaps overlap: the difference between
batches of 20 and of 10 calls, free of a batch's fixed cost (some older rows
hold means over one batch of 10: docs/benchmarks_method.md). Each of our forward
and backward figures, and each XLA fp8 baseline, is timed in alternation with
cuBLAS bf16 on the same shape (`_time_vs`, `common.time_interleaved`: 7 rounds,
medians), and its ratio is taken against that paired cuBLAS time: FP8 GEMMs slow
down as the chip heats within seconds, so timing one after the other moved the
ratio from 1.22x to 1.35x at 16384x4096x4096. Other figures are the median of 7
repeats (`_time`). The memory-bound kernels (quantize, compared with the copy
bandwidth) run four distinct inputs per call in batches of 30 and 60 calls
(`_time_mem`): with 10 calls, a batch's fixed overhead (~70 us on the H200)
added ~7 us to a 60 us call, and with one input per call the host's ~32 us
dispatch bounded the narrow shapes' ~28 us kernels. The 1 GiB copy ceiling (0.5
ms per call) reads the same with one or two copies per call.
"""

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import common
from pallas_kernels import Fp8Output, fp8, rms_norm, rms_norm_reference
from pallas_kernels.fp8 import (
  mosaic_gpu_matmul,
  mosaic_gpu_quantize,
  mosaic_gpu_quantizing_matmul,
)
from pallas_kernels.fp8 import reference as ref

NAME = "fp8_matmul"
SHAPES = [(16384, 4096, 4096), (65536, 2048, 512), (65536, 512, 2048)]
F8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
DN = (((1,), (0,)), ((), ()))
GOAL_FWD, GOAL_BWD, GOAL_QUANT = 1.3, 1.5, 0.7
QUICK = False  # --quick: the default format (deepseek) only
NO_BWD = False  # --no-bwd: forward and kernels only (short device runs)
OUT_DIR = None
T0 = time.perf_counter()


def _time(fn, arg_sets) -> float:
  return common.device_time(fn, arg_sets, calls=10)


def _pullback(fn, *primals):
  """`fn`'s pullback with the residuals of a forward run (a pytree: the
  timed program takes it as an argument, `_apply`)."""
  return jax.jit(lambda *p: jax.vjp(fn, *p)[1])(*primals)


_apply = jax.jit(lambda pull, dy: pull(dy))


def _weight_quantizer(fmt_name="deepseek", hb=None):
  """The weight's quantization, jitted: once per step, outside the timed
  functions (as in training)."""
  return jax.jit(
    lambda w: fp8.quantize(
      w, axis=0, kind="weight", format=fmt_name, hadamard=hb
    ).detach()
  )


def _our_pullbacks(sets, fmt_name="deepseek", hb=None, rhs_fp8=False):
  """`(pullback, dy)` per input set: the backward of our FP8 dense layer as
  `_apply` runs it. Weights are quantized once per step, outside the timed
  function; the pullback is taken with respect to x and w, as a training
  step differentiates its parameters: its outputs are dx and dw, as
  cuBLAS's are (differentiating the quantized tensor itself would also
  return zeros for its e4m3 values, a 16 MB fill at 4096 x 4096)."""
  qw = _weight_quantizer(fmt_name, hb)

  def pullback(x, w):
    wq = qw(w)

    def f(x, w):
      return fp8.fp8_dot_general(
        x,
        dataclasses.replace(wq, source=w),
        DN,
        format=fmt_name,
        hadamard=hb,
        grad_rhs_fp8=rhs_fp8,
      )

    return _pullback(f, x, w)

  return [(pullback(x, w), dy) for x, w, dy in sets]


def _time_vs(b, case, label, kind, fn, arg_sets, base):
  """Seconds per call of `fn` and of cuBLAS bf16 `base = (fn, arg_sets)`,
  timed in alternation (`common.time_interleaved`); `fn`'s `{kind} ms` is
  recorded against that paired cuBLAS time."""
  t = common.time_interleaved({"ours": (fn, arg_sets), "cuBLAS": base})
  t, tb = t["ours"], t["cuBLAS"]
  b.add(
    case,
    label,
    f"{kind} ms",
    t * 1e3,
    baseline="xla bf16 (cuBLAS)",
    baseline_value=tb * 1e3,
    lower_is_better=True,
  )
  return t, tb


def _time_mem(fn, arg_sets) -> float:
  """Seconds per input of a memory-bound kernel: every input of `arg_sets`
  in one jitted call (`common.all_sets`), 30 calls queued. One input per
  call timed the host instead at the narrow shapes: a 64 MiB input is
  quantized in ~28 us, under the ~32 us the host takes to dispatch one
  call (the measurement: docs/kernels/fp8.md)."""
  sec = common.device_time(common.all_sets(fn), [(arg_sets,)], calls=30)
  return sec / len(arg_sets)


def _mem_inputs(m, k):
  """Four distinct bf16 `[m, k]` inputs (`(x,)` sets) for `_time_mem`."""
  return [
    (jax.random.normal(jax.random.key(100 + s), (m, k), BF16),)
    for s in range(4)
  ]


@jax.jit
def _rel_j(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def _rel(a, b) -> float:
  # Jitted (as every check below): op-by-op dispatch compiles each small op
  # separately, which is what made a shape take minutes on the device.
  return float(_rel_j(a, b))


def _kernel_operands(x, w, *, ablk, bblk):
  """Quantized operands of the matmul kernel alone, scales in its layout."""
  m, n = x.shape[0], w.shape[1]
  av, as_ = ref.quantize_reference(x, block=ablk)
  bv, bs_ = ref.quantize_reference(w.T, block=bblk)
  sa = jnp.repeat(as_.T, ablk[0], axis=1)[:, :m]
  sb = jnp.repeat(bs_.T, bblk[0], axis=1)[:, :n]
  return av, as_, bv, bs_, sa, sb


def _same(v, se, rv, rs, br):
  """Fractions of values and of scales equal to the reference's."""
  same_v, same_s = jax.jit(
    lambda v, se, rv, rs: (
      jnp.mean((v.astype(jnp.float32) == rv.astype(jnp.float32)) * 1.0),
      jnp.mean((se[:, ::br].T == rs) * 1.0),
    )
  )(v, se, rv, rs)
  return float(same_v), float(same_s)


class Bench:
  def __init__(self, name: str = NAME):
    self.name = name  # the results file, benchmarks/results/<name>.json
    self.records = []
    self.failures = []

  def run(self, label, thunk):
    """Run `thunk`, print and keep its failure instead of stopping."""
    try:
      return thunk()
    except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
      msg = f"{label}: {type(e).__name__}: {str(e)[:1500]}"
      print("FAILED", msg, flush=True)
      traceback.print_exc(limit=4)
      self.failures.append(msg)
      return None

  def save(self):
    """Keep what was measured so far under `--out` (a run cut short still
    reports it)."""
    if OUT_DIR:
      path = pathlib.Path(OUT_DIR) / f"{self.name}.partial.json"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(self.records, indent=1) + "\n")

  def add(self, *args, **kwargs):
    r = common.record(self.name, *args, **kwargs)
    self.records.append(r)
    self.save()
    print(
      f"{time.perf_counter() - T0:6.1f}s"
      f"  {r['case']:<28} {r['impl']:<34} {r['metric']:<12}"
      f" {r['value']:10.4g}"
      + (f"  x{r['ratio']:.3f} vs {r['baseline']}" if r["ratio"] else ""),
      flush=True,
    )


def copy_bandwidth(b: Bench) -> float:
  """Device copy bandwidth (bytes read + written), best of two XLA ops,
  measured as the other benchmarks measure it (1 GiB, 30 queued calls). On
  the H200, 512 MiB and 10 calls read 3.60 TB/s where this reads 4.10: the
  lower ceiling flattered the quantize kernel's fraction."""
  nbytes = 1 << (17 if jax.default_backend() == "cpu" else 30)
  bws = common.copy_bandwidths(nbytes)
  for name, bw in bws.items():
    b.add(f"copy {nbytes >> 20}MiB bf16", name, "TB/s", bw)
  return max(bws.values()) * 1e12


def _inputs(m, k, n, seed):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), BF16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(BF16)
  dy = jax.random.normal(kd, (m, n), BF16)
  return x, w, dy


def per_tensor_fp8(x, w8, sw):
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  sx = jnp.maximum(amax / 448.0, 1e-30)
  x8 = (x.astype(jnp.float32) / sx).astype(F8)
  y = jnp.dot(x8, w8, preferred_element_type=jnp.float32)
  return (y * (sx * sw)).astype(BF16)


DN_TN = (((1,), (1,)), ((), ()))  # both operands contract their last dim


def _bwd_bound(b: Bench, case, sets, bf16_bwd_pair, dw_fp8: bool):
  """What the backward could reach with cuBLAS's own FP8 GEMM and nothing
  else: `dx = dy w^T` (and with `dw_fp8` also `dw = x^T dy`) on operands
  cast to e4m3 and laid out for cuBLAS (contraction dim last) before the
  timer starts, one scale of 1 per tensor; the rest in bf16 as cuBLAS does
  it. No quantization pass, no block scales: a bound on any FP8 backward
  (ours pays both), timed against the bf16 backward like ours."""
  label = "cuBLAS fp8 GEMMs only (bound), dW " + ("fp8" if dw_fp8 else "bf16")

  def bwd(dy8, w8, x, dy, x8t, dy8t):
    dx = lax.dot_general(dy8, w8, DN_TN, preferred_element_type=BF16)
    if dw_fp8:
      dw = lax.dot_general(x8t, dy8t, DN_TN, preferred_element_type=BF16)
    else:
      dw = jnp.dot(x.T, dy)
    return dx, dw

  args = []
  for x, w, dy in sets:
    x8t = x.T.astype(F8) if dw_fp8 else None
    dy8t = dy.T.astype(F8) if dw_fp8 else None
    args.append((dy.astype(F8), w.astype(F8), x, dy, x8t, dy8t))
  t, tb = _time_vs(b, case, label, "bwd", jax.jit(bwd), args, bf16_bwd_pair)
  b.add(case, label, "bwd speedup", tb / t, baseline="xla bf16 (cuBLAS)")


def bench_shape(b: Bench, m, k, n, copy_bw):
  case = f"{m}x{k}x{n}"
  flops = 2 * m * k * n
  sets = [_inputs(m, k, n, s) for s in (0, 1)]
  print(f"== {case}", flush=True)

  def tflops(t):
    return flops / t / 1e12

  # ---- forward baselines
  bf16_fwd = jax.jit(lambda x, w: jnp.dot(x, w))
  bf16_pair = (bf16_fwd, [(x, w) for x, w, _ in sets])
  t_bf16 = _time(*bf16_pair)
  b.add(case, "xla bf16 (cuBLAS)", "fwd ms", t_bf16 * 1e3, lower_is_better=True)
  b.add(case, "xla bf16 (cuBLAS)", "fwd TFLOP/s", tflops(t_bf16))
  w8s = [(w.astype(F8), jnp.float32(1)) for _, w, _ in sets]

  def fwd_ms(label, fn, args):
    return _time_vs(b, case, label, "fwd", fn, args, bf16_pair)

  def base(label, fn, args):
    pair = b.run(label, lambda: fwd_ms(label, jax.jit(fn), args))
    return None if pair is None else pair[0]

  base(
    "xla fp8 GEMM only (pre-cast)",
    lambda x8, w8: jnp.dot(x8, w8, preferred_element_type=BF16),
    [(x.astype(F8), w8) for (x, _, _), (w8, _) in zip(sets, w8s, strict=True)],
  )
  base(
    "xla fp8 cast",
    lambda x, w8: jnp.dot(x.astype(F8), w8, preferred_element_type=BF16),
    [(x, w8) for (x, _, _), (w8, _) in zip(sets, w8s, strict=True)],
  )
  base(
    "xla fp8 per-tensor scale",
    per_tensor_fp8,
    [(x, w8, sw) for (x, _, _), (w8, sw) in zip(sets, w8s, strict=True)],
  )

  # ---- backward baseline
  def bf16_bwd(x, w, dy):
    return jax.vjp(jnp.dot, x, w)[1](dy)

  if not NO_BWD:
    bf16_bwd_pair = (
      _apply,
      [(_pullback(jnp.dot, x, w), dy) for x, w, dy in sets],
    )
    t_bf16_b = _time(*bf16_bwd_pair)
    b.add(
      case, "xla bf16 (cuBLAS)", "bwd ms", t_bf16_b * 1e3, lower_is_better=True
    )
    for dw_fp8 in (False, True):
      b.run(
        f"{case} backward bound dW fp8={dw_fp8}",
        functools.partial(_bwd_bound, b, case, sets, bf16_bwd_pair, dw_fp8),
      )

  # ---- ours
  variants = [
    ("mxfp8", None),
    ("deepseek", None),
    ("mxfp8", 32),
    ("deepseek", 128),
  ]
  if QUICK:
    variants = [("deepseek", None)]
  for fmt_name, hb in variants:
    label = f"ours {fmt_name}" + (f" H{hb}" if hb else "")

    def fwd_case(fmt_name=fmt_name, hb=hb, label=label):
      qw = _weight_quantizer(fmt_name, hb)
      wqs = [qw(w) for _, w, _ in sets]
      f = jax.jit(
        lambda x, wq: fp8.fp8_dot_general(
          x, wq, DN, format=fmt_name, hadamard=hb
        )
      )
      # Correctness at this shape: against the XLA reference path.
      x0 = sets[0][0]
      got = f(x0, wqs[0])
      want = jax.jit(
        lambda x, wq: fp8.fp8_dot_general(
          x, wq, DN, format=fmt_name, hadamard=hb, implementation="xla"
        )
      )(x0, wqs[0])
      exact = jnp.dot(
        x0.astype(jnp.float32),
        sets[0][1].astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
      )
      b.add(case, label, "fwd err vs ref", _rel(got, want))
      b.add(case, label, "fwd err vs f32", _rel(got, exact))
      t, tb = fwd_ms(
        label, f, [(x, wq) for (x, _, _), wq in zip(sets, wqs, strict=True)]
      )
      b.add(
        case,
        label,
        "fwd speedup",
        tb / t,
        baseline="goal",
        goal=GOAL_FWD,
      )

    b.run(f"{case} {label} fwd", fwd_case)

  def prequantized_case():
    """x arriving in fp8 (as from the RMSNorm with fused quantization): the
    forward is then the GEMM and its glue alone."""
    q = jax.jit(
      lambda x, w: (
        fp8.quantize(x, axis=1, kind="activation").detach(),
        fp8.quantize(w, axis=0, kind="weight").detach(),
      )
    )
    qsets = [q(x, w) for x, w, _ in sets]
    label = "ours deepseek, x pre-quantized"
    t = base(label, lambda xq, wq: fp8.fp8_dot_general(xq, wq, DN), qsets)
    if t is not None:
      b.add(case, label, "fwd TFLOP/s", tflops(t))

  b.run(f"{case} prequantized fwd", prequantized_case)

  def quantize_first_case():
    """x quantized by its own pass, then the GEMM: the forward where the
    GEMM does not quantize x itself (n > primitives.QUANTIZE_IN_GEMM_MAX_N, or
    differentiated with an FP8 weight gradient, which keeps x's values)."""
    qw = _weight_quantizer()
    label = "ours deepseek, quantize pass + GEMM"
    base(
      label,
      lambda x, wq: fp8.fp8_dot_general(
        fp8.quantize(x, axis=1).detach(), wq, DN
      ),
      [(x, qw(w)) for x, w, _ in sets],
    )

  b.run(f"{case} quantize-first fwd", quantize_first_case)

  bwd_variants = [
    ("mxfp8", None, False),
    ("deepseek", None, False),
    ("mxfp8", None, True),
  ]
  if QUICK:
    bwd_variants = [("deepseek", None, False), ("deepseek", None, True)]
  if NO_BWD:
    bwd_variants = []
  for fmt_name, hb, rhs_fp8 in bwd_variants:
    label = f"ours {fmt_name}" + (" dW fp8" if rhs_fp8 else " dW bf16")

    def bwd_case(fmt_name=fmt_name, hb=hb, rhs_fp8=rhs_fp8, label=label):
      psets = _our_pullbacks(sets, fmt_name, hb, rhs_fp8)
      x0, w0, dy0 = sets[0]
      dx, dw = _apply(*psets[0])
      rdx, rdw = jax.jit(bf16_bwd)(
        x0.astype(jnp.float32), w0.astype(jnp.float32), dy0.astype(jnp.float32)
      )
      b.add(case, label, "dx err vs f32", _rel(dx, rdx))
      b.add(case, label, "dw err vs f32", _rel(dw, rdw))
      t, tb = _time_vs(b, case, label, "bwd", _apply, psets, bf16_bwd_pair)
      b.add(
        case,
        label,
        "bwd speedup",
        tb / t,
        baseline="goal",
        goal=GOAL_BWD,
      )

    b.run(f"{case} {label} bwd", bwd_case)

  # ---- the kernels alone (the default configurations of primitives.py)
  kernels = [(32, (32, 32), (32, 32)), (128, (1, 128), (128, 128))]
  if QUICK:
    kernels = kernels[1:]
  for kb, ablk, bblk in kernels:

    def kernel_case(kb=kb, ablk=ablk, bblk=bblk):
      x, w, _ = sets[0]
      av, as_, bv, bs_, sa, sb = jax.jit(
        functools.partial(_kernel_operands, ablk=ablk, bblk=bblk)
      )(x, w)
      f = functools.partial(
        mosaic_gpu_matmul.scaled_matmul_mgpu,
        kb=kb,
        block_sizes=mosaic_gpu_matmul.default_block_sizes(kb),
        b_scale_uniform=bblk[0] == 128,
      )
      got = f(av, sa, bv, sb)
      want = jax.jit(
        lambda av, as_, bv, bs_: ref.scaled_matmul_reference(
          av, as_, ablk, bv, bs_, bblk, out_dtype=BF16
        )
      )(av, as_, bv, bs_)
      b.add(case, f"kernel matmul kb={kb}", "err vs ref", _rel(got, want))
      t = _time(f, [(av, sa, bv, sb)] * 2)
      b.add(
        case,
        f"kernel matmul kb={kb}",
        "TFLOP/s",
        tflops(t),
        baseline="xla bf16 (cuBLAS)",
        baseline_value=tflops(t_bf16),
      )

    b.run(f"{case} kernel kb={kb}", kernel_case)
  bench_quantize(b, m, k, n, copy_bw)


def bench_quantize(b: Bench, m, k, n, copy_bw):
  """The quantize kernels alone (with and without Hadamard) on `[m, k]`
  inputs against the copy bandwidth, and the copy at the input's own
  size (recorded under the shape's case, `m x k x n`)."""
  case = f"{m}x{k}x{n}"
  quants = [((32, 32), None), ((32, 32), 32), ((1, 128), None), ((1, 128), 128)]
  if QUICK:
    quants = quants[2:]

  # The copy ceiling at this input's own size: a 64 MiB input is moved in
  # tens of microseconds, where launch and ramp weigh on any kernel (the
  # goal stays judged against the 1 GiB ceiling; this says how much of the
  # gap is the size). Timed as the quantize kernels are (`_time_mem`).
  same_bw = None
  xs = _mem_inputs(m, k)

  def same_size_copy():
    nonlocal same_bw
    bws = {
      name: 2 * m * k * 2 / _time_mem(op, xs) / 1e12
      for name, op in common.COPY_OPS.items()
    }
    for name, bw in bws.items():
      b.add(case, f"{name} (same size)", "TB/s", bw)
    same_bw = max(bws.values())

  b.run(f"{case} same-size copy", same_size_copy)

  for block, hb in quants:
    label = f"kernel quantize {block[0]}x{block[1]}" + (f" H{hb}" if hb else "")

    def quant_case(block=block, hb=hb, label=label):
      f = jax.jit(
        lambda x: mosaic_gpu_quantize.quantize_mgpu(x, block=block, hadamard=hb)
      )
      v, se = f(xs[0][0])
      fx = jax.jit(
        lambda x: ref.quantize_reference(x, block=block, hadamard=hb)
      )
      rv, rs = fx(xs[0][0])
      same_v, same_s = _same(v, se, rv, rs, block[0])
      b.add(case, label, "values equal", same_v)
      b.add(case, label, "scales equal", same_s)
      t = _time_mem(f, xs)
      nbytes = 3 * m * k + 4 * m * (k // block[1])
      b.add(
        case,
        label,
        "TB/s",
        nbytes / t / 1e12,
        baseline="copy bandwidth",
        baseline_value=copy_bw / 1e12,
        goal=GOAL_QUANT,
      )
      if same_bw:
        frac = nbytes / t / 1e12 / same_bw
        b.add(
          case,
          label,
          "of same-size copy",
          frac,
          baseline="same-size copy TB/s",
          baseline_value=same_bw,
          ratio=frac,
        )
      tx = _time_mem(fx, xs)
      b.add(
        case,
        label.replace("kernel", "xla"),
        "TB/s",
        nbytes / tx / 1e12,
        baseline="copy bandwidth",
        baseline_value=copy_bw / 1e12,
      )

    b.run(f"{case} {label}", quant_case)


def bench_norm_dense(b: Bench, m, k, n):
  """`y, h = rms_norm(x, gamma, residual)` then `y w`, as every FP8 dense
  layer behind a norm in the model runs (`gemjax.model.layers`), at the
  shape `x [m, k]`, `w [k, n]`. Against XLA's norm (one fusion) and cuBLAS
  bf16: our norm kernel with its output quantized in the same kernel
  (`quantize=`, what the model does) and the FP8 GEMM; our norm in bf16 and
  the FP8 op quantizing it (its own quantize pass, or the quantizing GEMM
  at n <= 512); our norm and cuBLAS bf16. Weights quantized once per step
  beforehand, as in `bench_shape`. Forward, then the backward (pullback on
  saved residuals, w.r.t. x, residual, gamma and w, cotangents for y w and
  h), all variants timed in alternation (`common.time_interleaved`)."""
  case = f"{m}x{k}x{n} rmsnorm+dense"
  print(f"== {case}", flush=True)
  sets = []
  for s in (0, 1):
    x, w, dy = _inputs(m, k, n, s)
    kr, kg, kh = jax.random.split(jax.random.key(50 + s), 3)
    r = jax.random.normal(kr, (m, k), BF16)
    g = (1 + 0.1 * jax.random.normal(kg, (k,), jnp.float32)).astype(BF16)
    dh = jax.random.normal(kh, (m, k), BF16)
    sets.append((x, r, g, w, dy, dh))
  q8 = Fp8Output(format="deepseek")

  def xla(x, r, g, w):
    y, h = rms_norm_reference(x, g, r)
    return jnp.dot(y, w), h

  def ours_bf16(x, r, g, w):
    y, h = rms_norm(x, g, r)
    return jnp.dot(y, w), h

  def ours_fp8(x, r, g, wq, fused=True, impl=None):
    y, h = rms_norm(
      x, g, r, quantize=q8 if fused else None, implementation=impl
    )
    return fp8.fp8_dot_general(y, wq, DN, implementation=impl), h

  base = "xla: rms_norm + bf16 dot (cuBLAS)"
  variants = {
    base: (xla, False),
    "ours: norm -> fp8 in one kernel, fp8 GEMM": (ours_fp8, True),
    "ours: norm, fp8 op quantizes": (
      functools.partial(ours_fp8, fused=False),
      True,
    ),
    "ours: norm, bf16 dot (cuBLAS)": (ours_bf16, False),
  }
  qw = _weight_quantizer()
  wqs = [qw(w) for _, _, _, w, _, _ in sets]

  def fwd_args(fp8_w):
    return [
      (x, r, g, wq if fp8_w else w)
      for (x, r, g, w, _, _), wq in zip(sets, wqs, strict=True)
    ]

  runs = {
    name: (jax.jit(fn), fwd_args(fp8_w))
    for name, (fn, fp8_w) in variants.items()
  }
  # Correctness at this shape: the fused path against the same math in XLA
  # (reference norm with its FP8 output, XLA FP8 matmul) and against f32.
  label = "ours: norm -> fp8 in one kernel, fp8 GEMM"
  x0, r0, g0, w0, _, _ = sets[0]
  got = runs[label][0](x0, r0, g0, wqs[0])[0]
  want = jax.jit(functools.partial(ours_fp8, impl="xla"))(x0, r0, g0, wqs[0])[0]
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  exact = jax.jit(
    lambda x, r, g, w: jnp.dot(
      rms_norm_reference(f32(x), f32(g), f32(r))[0],
      f32(w),
      precision=lax.Precision.HIGHEST,
    )
  )(x0, r0, g0, w0)
  b.add(case, label, "fwd err vs ref", _rel(got, want))
  b.add(case, label, "fwd err vs f32", _rel(got, exact))
  _record_interleaved(b, case, "fwd", runs, base)
  if NO_BWD:
    return

  def pullback(fn, fp8_w, x, r, g, w, wq):
    if not fp8_w:
      return _pullback(fn, x, r, g, w)
    return _pullback(
      lambda x, r, g, w: fn(x, r, g, dataclasses.replace(wq, source=w)),
      x, r, g, w,
    )  # fmt: skip

  runs = {
    name: (
      _apply,
      [
        (pullback(fn, fp8_w, x, r, g, w, wq), (dy, dh))
        for (x, r, g, w, dy, dh), wq in zip(sets, wqs, strict=True)
      ],
    )
    for name, (fn, fp8_w) in variants.items()
  }
  _record_interleaved(b, case, "bwd", runs, base)


def parts(b: Bench, m, k, n, calls: int = 20, top: int = 6):
  """Where the time goes (`--parts`): the device time per call of each
  kernel of our forward and backwards (deepseek format, dW in BF16 and in
  FP8) and of cuBLAS bf16's, from a profiler trace of `calls` queued calls
  (`common.trace_summary`; `main` turns XLA's command buffers off for it).
  On a GPU the kernels are the events of its stream threads, summed over
  streams; on the CPU (`--tiny`, a dry run) every thread of the host's.
  Records `<program>: <kernel>` and `<program>: all kernels` in ms per
  call, into `results/fp8_matmul_parts.json`."""
  case = f"{m}x{k}x{n}"
  sets = [_inputs(m, k, n, s) for s in (0, 1)]
  qw = _weight_quantizer()
  wqs = [qw(w) for _, w, _ in sets]
  programs = {
    "cuBLAS bf16 fwd": (jax.jit(jnp.dot), [(x, w) for x, w, _ in sets]),
    "ours fwd": (
      jax.jit(lambda x, wq: fp8.fp8_dot_general(x, wq, DN)),
      [(x, wq) for (x, _, _), wq in zip(sets, wqs, strict=True)],
    ),
    "cuBLAS bf16 bwd": (
      _apply,
      [(_pullback(jnp.dot, x, w), dy) for x, w, dy in sets],
    ),
    "ours bwd dW bf16": (_apply, _our_pullbacks(sets)),
    "ours bwd dW fp8": (_apply, _our_pullbacks(sets, rhs_fp8=True)),
  }
  gpu = jax.default_backend() == "gpu"
  device = "/device:GPU" if gpu else "/host:CPU"
  for name, (fn, args) in programs.items():

    def one(name=name, fn=fn, args=args):
      jax.block_until_ready(fn(*args[0]))  # compiled and run once
      with tempfile.TemporaryDirectory() as log_dir:
        common.trace_calls(fn, args, calls, log_dir)
        threads = common.trace_summary(log_dir, calls, top=64, device=device)
      kernels, total = {}, 0.0
      for key, t in threads.items():
        busy = t["other_ms"] + t["collective_ms"]
        print(
          f"  {name} | {key}: {busy:.4f} ms; "
          + ", ".join(f"{op[:48]} {ms:.4f}" for op, ms in t["top"][:top]),
          flush=True,
        )
        if gpu and "stream" not in key.lower():
          continue  # XLA's op and module rows span the kernels again
        total += busy
        for op, ms in t["top"]:
          kernels[op] = kernels.get(op, 0.0) + ms
      if not kernels:
        raise RuntimeError(f"{name}: no kernel in the trace ({list(threads)})")
      b.add(case, f"{name}: all kernels", "ms/call", total)
      for op, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        b.add(case, f"{name}: {op[:64]}", "ms/call", ms)

    b.run(f"{case} parts {name}", one)


def _record_interleaved(b: Bench, case, kind, runs, base):
  """Time `runs` in alternation; each one's `{kind} ms` against `base`'s."""
  times = common.time_interleaved(runs, skip_failures=True)
  for label, t in times.items():
    b.add(
      case,
      label,
      f"{kind} ms",
      t * 1e3,
      baseline=None if label == base else base,
      baseline_value=None if label == base else times[base] * 1e3,
      lower_is_better=True,
    )
    if label != base:
      b.add(case, label, f"{kind} speedup", times[base] / t, baseline=base)


def _sweep_configs():
  """(name, kb, BlockSizes, b_scale_uniform) of the matmul tile sweep."""
  B, D = mosaic_gpu_matmul.BlockSizes, mosaic_gpu_matmul.Dim
  k256 = dict(tile_k=256, max_concurrent_steps=2)
  c128 = {
    "64x128 wgM st4": B(),
    "64x128 wgM st5": B(max_concurrent_steps=5),
    "64x128x256 wgM st2 (2 in flight)": B(**k256),
    "64x128 wgM clusterM": B(cluster_dimension=D.M),
    "64x128 wgM clusterN": B(cluster_dimension=D.N),
    "64x128 wgN clusterM": B(wg_dimension=D.N, cluster_dimension=D.M),
    "64x128 wgM clusterM gw8": B(cluster_dimension=D.M, grid_tile_width=8),
    "64x128 wgM clusterM minorM": B(cluster_dimension=D.M, grid_minor_dim=D.M),
    "64x128x256 wgM clusterM st2 (2 in flight)": B(
      cluster_dimension=D.M, **k256
    ),
    "64x128x256 wgN clusterM st2 (2 in flight)": B(
      wg_dimension=D.N, cluster_dimension=D.M, **k256
    ),
    "64x128 wgN clusterM minorM": B(
      wg_dimension=D.N, cluster_dimension=D.M, grid_minor_dim=D.M
    ),
    "64x128 wgN clusterM st3": B(
      wg_dimension=D.N, cluster_dimension=D.M, max_concurrent_steps=3
    ),
    # Three compute warpgroups stacked along M (192 x 128 CTA tiles).
    "64x128 3wgM gw8 mr24 (default)": B(
      compute_wgs=3, grid_tile_width=8, memory_registers=24
    ),
    "64x128 3wgM gw8": B(compute_wgs=3, grid_tile_width=8),
    "64x128 3wgM gw4 mr24": B(compute_wgs=3, memory_registers=24),
    "64x128 3wgM gw16 mr24": B(
      compute_wgs=3, grid_tile_width=16, memory_registers=24
    ),
    "64x128 3wgM clusterN gw8 mr24": B(
      compute_wgs=3,
      cluster_dimension=D.N,
      grid_tile_width=8,
      memory_registers=24,
    ),
    "64x128 3wgM clusterM gw8 mr24": B(
      compute_wgs=3,
      cluster_dimension=D.M,
      grid_tile_width=8,
      memory_registers=24,
    ),
  }
  out = [("64x128 wgM st4 (unfolded)", 128, B(), False)]
  out += [(name, 128, bs, True) for name, bs in c128.items()]
  out += [
    ("64x128 wgM st4", 32, B(), False),
    ("64x128 wgM clusterM", 32, B(cluster_dimension=D.M), False),
  ]
  return out


def sweep(b: Bench, only: str | None = None):
  """Tile configurations of the matmul kernel at 16384x4096x4096, each
  checked against the reference, then timed in alternation with each other
  and with cuBLAS bf16 and fp8 (`common.time_interleaved`, 5 rounds)."""
  m, k, n = SHAPES[0]
  case = "sweep 16384x4096x4096"
  x, w, _ = _inputs(m, k, n, 0)
  flops = 2 * m * k * n
  x8, w8 = x.astype(F8), w.astype(F8)
  runs = {
    "xla bf16 (cuBLAS)": (jax.jit(jnp.dot), [(x, w)]),
    "xla fp8 GEMM only (pre-cast)": (
      jax.jit(lambda a, c: jnp.dot(a, c, preferred_element_type=BF16)),
      [(x8, w8)],
    ),
  }
  ops = {}
  for kb, ablk, bblk in [(32, (32, 32), (32, 32)), (128, (1, 128), (128, 128))]:
    av, as_ = ref.quantize_reference(x, block=ablk)
    bv, bs_ = ref.quantize_reference(w.T, block=bblk)
    sa = jnp.repeat(as_.T, ablk[0], axis=1)[:, :m]
    sb = jnp.repeat(bs_.T, bblk[0], axis=1)[:, :n]
    want = ref.scaled_matmul_reference(
      av, as_, ablk, bv, bs_, bblk, out_dtype=BF16
    )
    ops[kb] = (av, sa, bv, sb), want
  for name, kb, bs, uniform in _sweep_configs():
    label = f"kernel kb={kb} {name}"
    if only and not any(p in label for p in only.split(",")):
      continue

    def one(bs=bs, kb=kb, uniform=uniform, label=label):
      args, want = ops[kb]
      f = jax.jit(
        functools.partial(
          mosaic_gpu_matmul.scaled_matmul_mgpu,
          kb=kb,
          block_sizes=bs,
          b_scale_uniform=uniform,
        )
      )
      b.add(case, label, "err vs ref", _rel(f(*args), want))
      runs[label] = (f, [args])

    b.run(label, one)
  times = common.time_interleaved(runs, rounds=5, skip_failures=True)
  for label, t in times.items():
    b.add(case, label, "TFLOP/s", flops / t / 1e12)


def _qgemm_configs():
  """(name, QuantizingBlockSizes) of the quantizing GEMM's sweep."""
  Q, D = (
    mosaic_gpu_quantizing_matmul.QuantizingBlockSizes,
    mosaic_gpu_matmul.Dim,
  )
  return [
    ("quantizing (default)", Q()),
    ("quantizing clusterM", Q(cluster_m=2)),
    ("quantizing clusterM gw8", Q(cluster_m=2, grid_tile_width=8)),
    ("quantizing clusterM gw2", Q(cluster_m=2, grid_tile_width=2)),
    ("quantizing clusterM minorM", Q(cluster_m=2, grid_minor_dim=D.M)),
    ("quantizing clusterM4", Q(cluster_m=4)),
    ("quantizing clusterM4 gw8", Q(cluster_m=4, grid_tile_width=8)),
  ]


QGEMM_SHAPES = [(65536, 2048, 512), (65536, 512, 2048), (65536, 2048, 1024)]


def qgemm_sweep(b: Bench, only: str | None = None):
  """The GEMM that quantizes bf16 `a` itself (`quantizing_matmul_mgpu`),
  per configuration, against the op's quantize pass + GEMM on the same
  operands and cuBLAS bf16, all timed in alternation
  (`common.time_interleaved`, 5 rounds); each configuration's output is
  first compared with the quantize-first result, which it must equal bit
  for bit."""
  for m, k, n in QGEMM_SHAPES:
    _qgemm_shape(b, m, k, n, only)


def _qgemm_shape(b: Bench, m, k, n, only):
  case = f"qgemm sweep {m}x{k}x{n}"
  x, w, _ = _inputs(m, k, n, 0)
  wq = fp8.quantize(w, axis=0, kind="weight").detach()
  bv, bs_ = ref.quantize_reference(w.T, block=(128, 128))
  sb = jnp.repeat(bs_.T, 128, axis=1)[:, :n]
  first = jax.jit(
    lambda x, wq: fp8.fp8_dot_general(fp8.quantize(x, axis=1).detach(), wq, DN)
  )
  want = np.asarray(first(x, wq), np.float32)
  runs = {
    "xla bf16 (cuBLAS)": (jax.jit(jnp.dot), [(x, w)]),
    "quantize pass + GEMM": (first, [(x, wq)]),
  }
  for name, bs in _qgemm_configs():
    if only and not any(p in name for p in only.split(",")):
      continue

    def one(bs=bs, name=name):
      f = jax.jit(
        functools.partial(
          mosaic_gpu_quantizing_matmul.quantizing_matmul_mgpu,
          block_sizes=bs,
          b_scale_uniform=True,
        )
      )
      got = np.asarray(f(x, bv, sb), np.float32)
      diff = float(np.abs(got - want).max())
      b.add(case, name, "max |diff| vs quantize-first", diff)
      runs[name] = (f, [(x, bv, sb)])

    b.run(f"{case} {name}", one)
  times = common.time_interleaved(runs, rounds=5, skip_failures=True)
  base = times.get("xla bf16 (cuBLAS)")
  flops = 2 * m * k * n
  for label, t in times.items():
    b.add(
      case,
      label,
      "TFLOP/s",
      flops / t / 1e12,
      baseline="xla bf16 (cuBLAS)",
      baseline_value=flops / base / 1e12,
    )


def _ring(w, c=1, s=2, o=2, r=64):
  kw = dict(warpgroups=w, ctas_per_sm=c, stages=s, out_slots=o, tile_r=r)
  return f"ring wg{w} cta{c} st{s} out{o} rows{r}", kw


# (block, hadamard) -> [(name, quantize_mgpu keywords)] of the quantize sweep.
QUANT_SWEEP = {
  ((1, 128), None): [
    ("grid rows64 st2", dict(warpgroups=0, tile_r=64, stages=2)),
    _ring(1, c=4),
    _ring(2, c=2),
    _ring(4),
    _ring(4, o=1),
    _ring(4, o=3, s=1),
    _ring(2, s=4),
    _ring(1, c=2, r=128),
  ],
  ((1, 128), 128): [
    ("grid rows64 st2", dict(warpgroups=0, tile_r=64, stages=2)),
    _ring(1, c=2),
    _ring(3),
    _ring(4, o=1),
    _ring(4, s=1),
    _ring(2, s=3),
  ],
  ((32, 32), None): [
    ("grid rows64 st2", dict(warpgroups=0, tile_r=64, stages=2)),
    _ring(4),
  ],
}


def quant_sweep(b: Bench, copy_bw: float, only: str | None = None):
  """Tile rows, pipeline depth and the persistent ring form of the quantize
  kernel at 16384 x 4096."""
  m, k = SHAPES[0][:2]
  case = f"quantize sweep {m}x{k}"
  xs = _mem_inputs(m, k)
  for (block, hb), configs in QUANT_SWEEP.items():
    rv, rs = ref.quantize_reference(xs[0][0], block=block, hadamard=hb)
    nbytes = 3 * m * k + 4 * m * (k // block[1])
    for name, kw in configs:
      label = (
        f"kernel quantize {block[0]}x{block[1]}"
        + (f" H{hb}" if hb else "")
        + f" {name}"
      )
      if only and not any(p in label for p in only.split(",")):
        continue

      def one(
        block=block,
        hb=hb,
        kw=kw,
        label=label,
        rv=rv,
        rs=rs,
        nbytes=nbytes,
      ):
        f = jax.jit(
          lambda x: mosaic_gpu_quantize.quantize_mgpu(
            x, block=block, hadamard=hb, **kw
          )
        )
        v, se = f(xs[0][0])
        same_v = float(
          jnp.mean((v.astype(jnp.float32) == rv.astype(jnp.float32)) * 1.0)
        )
        same_s = float(jnp.mean((se[:, :: block[0]].T == rs) * 1.0))
        b.add(case, label, "values equal", same_v)
        b.add(case, label, "scales equal", same_s)
        t = _time_mem(f, xs)
        b.add(
          case,
          label,
          "TB/s",
          nbytes / t / 1e12,
          baseline="copy bandwidth",
          baseline_value=copy_bw / 1e12,
          goal=GOAL_QUANT,
        )

      b.run(label, one)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=None)
  p.add_argument("--shapes", default="all")
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument(
    "--sweep-filter",
    default=None,
    help="comma-separated substrings: sweep only the matching configs",
  )
  p.add_argument("--max-seconds", type=float, default=1e9)
  p.add_argument(
    "--tiny", action="store_true", help="small shapes: a dry run of the script"
  )
  p.add_argument("--quick", action="store_true")
  p.add_argument("--no-bwd", action="store_true")
  p.add_argument(
    "--quant-only",
    action="store_true",
    help="per shape only the quantize kernels and the same-size copy",
  )
  p.add_argument(
    "--bwd-shapes",
    default=None,
    help="comma-separated shape indices: the backward only at these",
  )
  p.add_argument(
    "--sweep-only",
    action="store_true",
    help="only the matmul tile sweep and the quantize kernel sweep",
  )
  p.add_argument(
    "--qgemm-sweep",
    action="store_true",
    help="only the quantizing GEMM's sweep (--sweep-filter applies)",
  )
  p.add_argument(
    "--norm-dense",
    action="store_true",
    help="only RMSNorm feeding the dense layer, per shape",
  )
  p.add_argument(
    "--parts",
    action="store_true",
    help="only where the time goes: kernel times of each program, per shape",
  )
  p.add_argument(
    "--quant-sweep",
    action="store_true",
    help="only the quantize kernel sweep (--sweep-filter applies)",
  )
  args = p.parse_args(argv)
  global QUICK, NO_BWD, OUT_DIR
  QUICK, NO_BWD, OUT_DIR = args.quick, args.no_bwd, args.out
  if args.parts:
    # Kernels launched one by one, not replayed from CUDA graphs, so the
    # trace has an event per kernel (set before the backend starts).
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer="
  print(jax.devices(), jax.__version__, flush=True)
  b = Bench(f"{NAME}_parts" if args.parts else NAME)
  copy_bw = None if args.parts else copy_bandwidth(b)
  shapes = (
    SHAPES
    if args.shapes == "all"
    else [SHAPES[int(i)] for i in args.shapes.split(",")]
  )
  if args.tiny:
    shapes = [(256, 256, 256)]
  t0 = time.perf_counter()
  if args.qgemm_sweep:
    shapes = []
    qgemm_sweep(b, args.sweep_filter)
  if args.sweep_only or args.quant_sweep:
    shapes = []
    quant_sweep(b, copy_bw, args.sweep_filter)
    if not args.quant_sweep:
      sweep(b, args.sweep_filter)
  bwd_shapes = (
    None
    if args.bwd_shapes is None
    else {SHAPES[int(i)] for i in args.bwd_shapes.split(",")}
  )
  for m, k, n in shapes:
    if time.perf_counter() - t0 > args.max_seconds:
      print(f"time limit: skipping {m}x{k}x{n}", flush=True)
      continue
    NO_BWD = args.no_bwd or (
      bwd_shapes is not None and (m, k, n) not in bwd_shapes
    )
    nd = functools.partial(bench_norm_dense, b, m, k, n)
    if args.parts:
      parts(b, m, k, n)
    elif args.quant_only:
      bench_quantize(b, m, k, n, copy_bw)
    elif args.norm_dense:
      b.run(f"{m}x{k}x{n} norm+dense", nd)
    else:
      bench_shape(b, m, k, n, copy_bw)
      b.run(f"{m}x{k}x{n} norm+dense", nd)
    b.save()
  if (
    not args.no_sweep
    and not args.sweep_only
    and not args.quant_sweep
    and not args.qgemm_sweep
    and not args.norm_dense
    and not args.parts
    and time.perf_counter() - t0 < args.max_seconds
  ):
    sweep(b, args.sweep_filter)
  # A --tiny dry run never touches benchmarks/results.
  common.write_results(b.name, b.records, out_dir=args.out, dry_run=args.tiny)
  if b.failures:
    print(f"{len(b.failures)} failures:")
    for f in b.failures:
      print(" ", f[:300])
  return 0


if __name__ == "__main__":
  sys.exit(main())
