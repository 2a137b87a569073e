"""Jagged attention: our Mosaic GPU kernels vs cuDNN on the padded layout.

    PYTHONPATH=. python3 benchmarks/jagged_attention.py [--out DIR] [--quick]

B=32 sequences, Lmax=2048, 8 query / 2 KV heads, bf16, D=64 and 128; length
mixes (a) log-normal (median 1100, sigma 0.6, capped at 2048), (b) uniform
1..2048, (c) all 2048; plus cross-attention (2048 queries per sequence over
256 keys) and ranking candidates (16 queries per sequence over log-normal
histories: the caller's `max_len_q=16` folds each KV group's 4 query heads
into one 64-row tile, also timed with `fold_heads=False` as `mosaic_apart`).
In one process: ours on the packed buffer (capacity = tokens + 64 tail rows
rounded up to 64, schedule built inside the timed call), cuDNN
`jax.nn.dot_product_attention(implementation="cudnn")` on the padded
`[B, Lmax]` layout with per-sample lengths (the padded copy is made outside
the timed call), and the XLA reference. Useful FLOPs only: `4 n h sum_b
Lq_b Lkv_b` forward, 3.5x that forward+backward. Each timed call runs R
independent input sets inside one jit (dispatch amortized, inputs rotated);
ours and cuDNN are timed in alternation, 7 rounds, and the median of the
per-set time is reported (`common.time_sets_interleaved`). The sets share
their offsets, so XLA builds the work list (which depends on offsets
only) once per call for all R (common subexpressions;
tests/benchmarks/test_common.py checks it), as a model's layers share one
per batch: the D64 log-normal
forward+backward (with dQ then added in f32) builds its lists in 39.5 us
(24 small kernels) and one call of one set spans 0.960 ms in an H200
profile, against 0.9295 ms per set timed here; the K/V side tiles, which
depend on the data, count in full.

Also timed: our forward kernel alone (work list and side tiles prebuilt)
and the backward's dQ (with delta) and dK/dV kernels alone, to show where
the time goes (`--breakdown`), and the op under other block sizes
(`--tune`: the variants in `TUNE`, none at present; the comment above it
lists those tried), and, with `--profile`, how evenly the SMs finish each
of our kernels in one forward+backward call (the Mosaic GPU profiler:
`pallas_kernels.mosaic.profiling`, `common.kernel_profile`; traces under
`--out`).
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

from benchmarks import smoke

os.environ["XLA_FLAGS"] = smoke.xla_flags(sys.argv)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from pallas_kernels import mosaic, schedule
from pallas_kernels.jagged_attention import mosaic_gpu as mg
from pallas_kernels.jagged_attention import mosaic_gpu_bwd_dkv as bwd_dkv
from pallas_kernels.jagged_attention import mosaic_gpu_bwd_dq as bwd_dq
from pallas_kernels.jagged_attention import mosaic_gpu_fwd as fwd
from pallas_kernels.jagged_attention.op import jagged_attention_mosaic
from pallas_kernels.jagged_attention.reference import (
  jagged_attention_reference,
)

B, LMAX, N, KH = 32, 2048, 8, 2
DTYPE = jnp.bfloat16
R = 4  # input sets per timed call
TAIL = 64
CANDS = 16  # candidate queries per sequence in the "cands" mix
MAX_REL_ERR = 2e-2  # ours vs cuDNN (both bf16, f32 accumulation)
CUDNN = "cudnn"
INTERPRET = None

# Goals from the issue, as ratios to cuDNN-padded useful TFLOP/s.
GOALS = {
  (128, "lognormal", "fwd"): 1.3,
  (128, "lognormal", "fwdbwd"): 1.15,
  (64, "lognormal", "fwd"): 1.5,
  (64, "lognormal", "fwdbwd"): 1.3,
  (128, "all2048", "fwd"): 0.9,
  (128, "all2048", "fwdbwd"): 0.9,
  (64, "all2048", "fwd"): 0.9,
  (64, "all2048", "fwdbwd"): 0.9,
}


def lengths(mix, rng):
  if mix == "lognormal":
    return common.lognormal_lengths(rng, B, LMAX)
  if mix == "uniform":
    return rng.integers(1, LMAX + 1, B).astype(np.int32)
  if mix in ("all2048", "cross"):
    return np.full(B, LMAX, np.int32)
  raise ValueError(mix)


def make_sets(h, q_lens, kv_lens, seed):
  q_off, kv_off = common.offsets(q_lens), common.offsets(kv_lens)
  # Buffer capacity: tokens plus a small tail, rounded to 64 rows as a
  # packer's static `max_tokens` would be.
  t = -(-(int(q_off[-1]) + TAIL) // 64) * 64
  s = -(-(int(kv_off[-1]) + TAIL) // 64) * 64
  sets = []
  for r in range(R):
    ks = jax.random.split(jax.random.key(seed * 100 + r), 4)
    q = jax.random.normal(ks[0], (t, N, h), DTYPE)
    k = jax.random.normal(ks[1], (s, KH, h), DTYPE)
    v = jax.random.normal(ks[2], (s, KH, h), DTYPE)
    do = jax.random.normal(ks[3], (t, N, h), DTYPE)
    sets.append((q, k, v, do))
  return q_off, kv_off, sets


def run_case(h, mix, rng, args, records, extra):
  cross = mix == "cross"
  if mix == "cands":
    kv_lens = lengths("lognormal", rng)
    q_lens = np.full(B, CANDS, np.int32)
    lmax_q, lmax_kv = CANDS, LMAX
  else:
    q_lens = lengths(mix, rng)
    lmax_q, lmax_kv = LMAX, (min(256, LMAX) if cross else LMAX)
    kv_lens = np.full(B, lmax_kv, np.int32) if cross else q_lens
  q_off, kv_off, sets = make_sets(h, q_lens, kv_lens, seed=h + len(mix))
  flops = 4.0 * N * h * float(np.sum(q_lens.astype(np.float64) * kv_lens))
  case = f"D{h}_{mix}"
  q_off_j, kv_off_j = jnp.asarray(q_off), jnp.asarray(kv_off)

  # The caller's static bounds, as a model passes them (max_len_q decides
  # the head fold).
  def ours(q, k, v, bs=None):
    return jagged_attention_mosaic(
      q,
      k,
      v,
      q_off_j,
      kv_off_j,
      max_len_q=lmax_q,
      max_len_kv=lmax_kv,
      block_sizes=bs,
    )

  def ref(q, k, v):
    return jagged_attention_reference(
      q, k, v, q_off_j, kv_off_j, max_len_q=lmax_q, max_len_kv=lmax_kv
    )

  padded = common.padded_sets(sets, q_off, kv_off, lmax_q, lmax_kv)
  cudnn = common.cudnn_padded(q_lens, kv_lens, CUDNN)
  # Jitted once: the check and the timed calls (R sets in one jit) reuse one
  # trace and one lowering of each kernel (compiles dominate a run).
  ours_fwd = jax.jit(lambda q, k, v, do: ours(q, k, v))
  ours_fb = jax.jit(common.fwd_bwd(ours))
  cudnn_fwd = jax.jit(lambda q, k, v, do: cudnn(q, k, v))
  cudnn_fb = jax.jit(common.fwd_bwd(cudnn))

  # Correctness at full scale: ours vs cuDNN on the real rows, forward and
  # gradients (see `common.checked`: a failure is recorded, not raised).
  def check():
    q, k, v, do = sets[0]
    valid_q = np.arange(lmax_q)[None, :] < q_lens[:, None]
    valid_kv = np.arange(lmax_kv)[None, :] < kv_lens[:, None]
    got = list(ours_fb(*sets[0]))
    default_grads[:] = got[1:]  # what the tune variants are checked against
    want = list(cudnn_fb(*padded[0]))
    errs = {}
    for name, g, w, off, lmax, valid in zip(
      ("o", "dq", "dk", "dv"),
      got,
      want,
      (q_off, q_off, kv_off, kv_off),
      (lmax_q, lmax_q, lmax_kv, lmax_kv),
      (valid_q, valid_q, valid_kv, valid_kv),
      strict=True,
    ):
      g = np.asarray(common.pad(g, off, lmax))[valid]
      errs[name] = common.rel_err(g, np.asarray(w)[valid])
    print(f"{case}: ours vs cuDNN rel err {errs}", flush=True)
    return errs

  default_grads = []
  errs = common.checked("jagged_attention", case, check, records, MAX_REL_ERR)

  # Timed in alternation (`common.time_sets_interleaved`): under sustained
  # load the H200 holds its 700 W cap by lowering the SM clock, and the
  # chip's state drifts over a run.
  runs = {}
  if errs is not None:
    runs["mosaic", "fwd"] = (ours_fwd, sets)
    runs["mosaic", "fwdbwd"] = (ours_fb, sets)
    if mix == "cands":  # the head fold's worth: the same op, heads apart
      apart = dataclasses.replace(mg.BlockSizes.default(h), fold_heads=False)
      fn = functools.partial(ours, bs=apart)
      runs["mosaic_apart", "fwd"] = (
        jax.jit(lambda q, k, v, do: fn(q, k, v)),
        sets,
      )
      runs["mosaic_apart", "fwdbwd"] = (jax.jit(common.fwd_bwd(fn)), sets)
  runs["cudnn", "fwd"] = (cudnn_fwd, padded)
  runs["cudnn", "fwdbwd"] = (cudnn_fb, padded)
  times = common.time_sets_interleaved(runs)
  if not args.quick:
    one = sets[:1]
    times["xla", "fwd"] = common.time_sets(
      lambda q, k, v, do: ref(q, k, v), one, 5
    )
    times["xla", "fwdbwd"] = common.time_sets(common.fwd_bwd(ref), one, 5)

  for (impl, kind), sec in times.items():
    mult = 3.5 if kind == "fwdbwd" else 1.0
    tf = flops * mult / sec / 1e12
    base = flops * mult / times["cudnn", kind] / 1e12
    print(
      f"{case:16s} {impl:7s} {kind:7s} {sec * 1e3:8.3f} ms "
      f"{tf:7.1f} useful TFLOP/s",
      flush=True,
    )
    records.append(
      common.record(
        "jagged_attention",
        case,
        impl,
        f"{kind}_ms",
        sec * 1e3,
        baseline=None if impl == "cudnn" else "cudnn_padded",
        baseline_value=None if impl == "cudnn" else times["cudnn", kind] * 1e3,
        lower_is_better=True,
      )
    )
    if impl != "cudnn":
      records.append(
        common.record(
          "jagged_attention",
          case,
          impl,
          f"{kind}_useful_tflops",
          tf,
          baseline="cudnn_padded",
          baseline_value=base,
          goal=GOALS.get((h, mix, kind)) if impl == "mosaic" else None,
        )
      )

  try:  # extra timings must not lose the main records
    if args.tune and mix == "lognormal":
      tune(h, case, q_off_j, kv_off_j, sets, extra, default_grads)
    if args.breakdown and mix in ("lognormal", "all2048"):
      breakdown(h, case, q_off_j, kv_off_j, sets, times, extra)
    if args.profile and mix in ("lognormal", "all2048"):
      profile(case, ours, sets, extra, args.out)
  except Exception as e:
    print(f"{case}: extra timings failed: {type(e).__name__}: {e}"[:2000])


# Variants beside each head dim's default (`BlockSizes.default`), timed
# forward + backward; none left to time (those measured, and what became
# of them: docs/kernels/jagged_attention.md).
TUNE = {128: [], 64: []}


def tune(h, case, q_off, kv_off, sets, extra, default_grads):
  """The op under other block sizes (see `TUNE`); each variant's gradients
  are checked against the default's first."""
  kind = "fwdbwd"
  for bs in TUNE[h]:

    def ours(q, k, v, bs=bs):
      return jagged_attention_mosaic(q, k, v, q_off, kv_off, block_sizes=bs)

    try:
      ours_fb = jax.jit(common.fwd_bwd(ours))
      grads = ours_fb(*sets[0])[1:]
      err = max(
        common.rel_err(g, w) for g, w in zip(grads, default_grads, strict=True)
      ) if default_grads else float("nan")  # fmt: skip
      sec = common.time_sets(ours_fb, sets)
    except Exception as e:  # e.g. shared memory overflow
      print(f"{case} {bs} {kind}: {type(e).__name__} {str(e)[:200]}")
      continue
    print(
      f"{case:16s} tune {kind:7s} {sec * 1e3:8.3f} ms  grads vs default "
      f"{err:.1e}  {bs}",
      flush=True,
    )
    extra.append(
      {"case": case, "part": f"tune_{kind} {bs}", "ms": sec * 1e3, "err": err}
    )


def profile(case, ours, sets, extra, out):
  """How evenly the SMs finish each of our kernels in one forward+backward
  call of the first input set: the program built again under the Mosaic
  GPU profiler (`mosaic.profiling`; the jagged kernels mark each work item
  a region), compiled first, then run once right after half a second of
  calls of the plain program, so the chip is warm when the profiled
  kernels write their traces (profiled right after compiling, on their
  first run, the spans read about 1.7x the timed figures;
  docs/kernels/jagged_attention.md). GPU only: interpret mode has no
  profiler."""
  if INTERPRET is not None:
    print(f"{case}: --profile needs a GPU (interpret mode has no profiler)")
    return
  root = pathlib.Path(out or tempfile.mkdtemp()) / f"profile_{case}"
  plain = jax.jit(common.fwd_bwd(ours))
  with mosaic.profiling(root):
    profiled = jax.jit(common.fwd_bwd(ours)).lower(*sets[0]).compile()
  jax.block_until_ready(plain(*sets[0]))  # compiled before the clock runs
  warm_until = time.perf_counter() + 0.5
  while time.perf_counter() < warm_until:  # one call queued at a time
    jax.block_until_ready(plain(*sets[0]))
  jax.block_until_ready(profiled(*sets[0]))
  jax.effects_barrier()  # the traces are written by host callbacks
  for kernel, s in common.kernel_profile(root).items():
    print(
      f"{case:16s} profile {kernel:7s} span {s['span_us']:8.1f} us, SM ends "
      f"max/mean {s['end_max_over_mean']:.3f}, tail idle "
      f"{100 * s['idle_share']:.1f}% ({s['regions']} items, {s['sms']} SMs)",
      flush=True,
    )
    extra.append({"case": case, "part": f"profile {kernel}", **s})


def breakdown(h, case, q_off, kv_off, sets, times, extra):
  """Kernel-only times of the head dim's default: the forward kernel with
  prebuilt work lists and side tiles, then the dQ and dK/dV kernels, or
  the fused backward's delta and dK/dV+dQ kernels (the latter with its dQ
  buffer's zero fill) and the fill alone, and the XLA pieces around
  them."""
  bs = mg.BlockSizes.default(h)
  static = mg._Static(
    causal=False, scale=h**-0.5, block_sizes=bs, interpret=INTERPRET
  )
  t = sets[0][0].shape[0]
  s = sets[0][1].shape[0]

  def prep(q, k, v, do):
    items, sched = schedule.query_items(
      q_off, kv_off, t, block_q=bs.block_q, block_kv=bs.block_kv, causal=False
    )
    items_kv = schedule.key_items(
      q_off,
      kv_off,
      s,
      sched.tile_start_b,
      block_q=bs.block_q,
      block_kv=2 * bs.block_kv_dkv,
      causal=False,
    )
    side = [schedule.side_tiles(x, kv_off, bs.block_kv) for x in (k, v)]
    o, lse = fwd.forward(q, k, v, *side, items, static)
    _, delta = bwd_dq.backward_dq(q, k, v, *side, o, do, lse, items, static)
    return dict(
      items=items,
      items_kv=items_kv,
      side=side,
      lse=lse,
      delta=delta,
      o=o,
    )

  preps = [jax.jit(prep)(*x) for x in sets]
  full = [(x, p) for x, p in zip(sets, preps, strict=True)]

  def t_fwd(x, p):
    q, k, v, _ = x
    return fwd.forward(q, k, v, *p["side"], p["items"], static)

  def t_dq(x, p):  # delta = rowsum(O dO) included
    q, k, v, do = x
    return bwd_dq.backward_dq(
      q, k, v, *p["side"], p["o"], do, p["lse"], p["items"], static
    )

  def t_dkv(x, p):
    q, k, v, do = x
    return bwd_dkv.backward_dkv(
      q, k, v, do, p["lse"], p["delta"], p["items_kv"], static
    )

  def t_delta(x, p):
    return bwd_dkv.backward_delta(p["o"], x[3], p["items"], static)

  def t_fused(x, p):
    q, k, v, do = x
    return bwd_dkv.backward_dkv_dq(
      q, k, v, do, p["lse"], p["delta"], p["items_kv"], static, p["side"][0]
    )

  def t_fill(x, p):
    return bwd_dkv.dq_buffer(x[0], p["items_kv"].shape[0], static)

  def t_sched(x, p):
    q, k, v, _ = x
    items, _ = schedule.query_items(
      q_off, kv_off, t, block_q=bs.block_q, block_kv=bs.block_kv, causal=False
    )
    side = [schedule.side_tiles(z, kv_off, bs.block_kv) for z in (k, v)]
    return items, side

  # The default backward's kernels only (the other's are in the notes).
  parts = [("fwd_kernel", t_fwd)]
  if bs.fused_bwd:
    parts += [
      ("fused_delta_kernel", t_delta),
      ("fused_dkv_dq_kernel_with_zero_fill", t_fused),
      ("fused_dq_zero_fill", t_fill),
    ]
  else:
    parts += [("dq_kernel_with_delta", t_dq), ("dkv_kernel", t_dkv)]
  parts.append(("fwd_schedule_and_side_tiles", t_sched))
  for name, fn in parts:
    try:
      sec = common.time_sets(fn, full)  # fn(x, p) per (inputs, prebuilt)
    except Exception as e:
      print(f"{case} {name}: {type(e).__name__} {str(e)[:300]}", flush=True)
      continue
    print(f"{case:16s} {name:40s} {sec * 1e3:8.3f} ms", flush=True)
    extra.append({"case": case, "part": name, "ms": sec * 1e3})


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--quick", action="store_true", help="no XLA ref")
  parser.add_argument("--breakdown", action="store_true")
  parser.add_argument(
    "--profile", action="store_true", help="per-SM balance of our kernels"
  )
  parser.add_argument("--tune", action="store_true")
  parser.add_argument("--dims", default="128,64")
  parser.add_argument(
    "--mixes", default="lognormal,all2048,uniform,cross,cands"
  )
  parser.add_argument("--smoke", action="store_true", help="CPU dry run")
  args = parser.parse_args()
  if args.smoke:  # tiny shapes, XLA instead of cuDNN, GPU interpret mode
    import jax.experimental.pallas.mosaic_gpu as plgpu

    global B, LMAX, R, CUDNN, INTERPRET
    B, LMAX, R, CUDNN = 2, 128, 1, "xla"
    common.TIMING.update(iters=1, repeats=1, rounds=1)
    INTERPRET = plgpu.InterpretGPUParams()
  print(common.device_name(), jax.__version__, flush=True)
  records, extra = [], []
  for h in map(int, args.dims.split(",")):
    for mix in args.mixes.split(","):
      rng = np.random.default_rng(0)  # same lengths for D=64 and D=128
      run_case(h, mix, rng, args, records, extra)
      # Written after every case, so a run cut short keeps what it measured.
      path = common.write_results(
        "jagged_attention", records, args.out, dry_run=args.smoke
      )
      if extra and args.out:
        pathlib.Path(args.out, "jagged_attention_breakdown.json").write_text(
          json.dumps(extra, indent=1)
        )
  print("wrote", path)


if __name__ == "__main__":
  main()
