"""GDPA (G2): our Mosaic GPU kernels vs cuDNN softmax attention and XLA.

    PYTHONPATH=. python3 benchmarks/gdpa.py [--out DIR] [--smoke]
        [--cases cross16,cross64,cross256,pooled]
        [--phases main,xla[,variants][,acts]] [--budget SECONDS]
        [--variants case:label,...]

D=128, 8 query heads over 2 KV heads (the model's GQA), bf16, in one
process:
- cross: B=32 sequences of 2,048 queries over 16, 64 or 256 keys each;
- pooled: 16 (learned) queries per sequence over log-normal histories
  (median 1,100, sigma 0.6, capped at 2,048).
Ours is `gdpa(activation="gelu_tanh", max_len_kv=...)` on the packed
buffers (schedule, side tiles and deal built inside the timed call, the
schedule once for the R input sets, which share offsets; the
default `tanh="exact"`, the hardware tanh, measured faster than the
polynomial; the caller's key-length bound picks the key tile); the
baselines
are cuDNN softmax attention (`jax.nn.dot_product_attention(
implementation="cudnn")`) on the padded `[B, L]` layout with per-sample
lengths, and an XLA GELU-attention (two einsums and a GELU) on the same
padded layout; padded copies are made outside the timed calls. Each
phase's programs are timed in alternation, 7 rounds, medians
(`common.time_sets_interleaved`). Also timed
(forward only, phase acts): our kernels with exact GELU, SiLU, the
polynomial tanh with its fallback and the unchecked polynomial
(`tanh="poly_unchecked"`, the seed's SFU saving; its numbers are only a
speed figure, since these unit-normal inputs leave its range).

Useful FLOPs only: `4 n h sum_b Lq_b Lkv_b` forward, 3.5x that forward +
backward (as in BASELINES.md). Short KV makes these shapes memory-bound,
so the forward is also reported as a fraction of the roofline
`min(peak, bandwidth x FLOP/byte)`, with bytes = Q + K + V + O once and the
peak (bf16 matmul) and bandwidth (copy) measured in this process. Where
that roofline is the bandwidth's (short keys, pooled), an XLA op that moves
the same bytes and does nothing else (`same_bytes`, timed in alternation
with ours and cuDNN) is reported on it too: how near it any op gets. Goals
(issue 4): forward >= 1.6x cuDNN, forward+backward >= 1.5x at every KV
length, forward >= 80% of the roofline. A correctness check against the
f32 reference (forward and the three gradients) runs first on every case.

Forward+backward is timed as a training step runs it: the output and the
three gradients (`fwd_bwd`), so our forward kernel stays in the program.

Phases, in the order given: `main` (the above without the XLA baseline,
every case; each program is jitted once per input set and checked on the
very program timed), `xla` (the XLA baseline, every case; `main,xla`, the
default, writes every record of `benchmarks/results/gdpa.json`),
`variants` (our forward and forward+backward under other settings in one
process, each with its difference to the default's outputs, and the XLA
work list + side tiles alone, within `--budget` seconds, optionally only
`--variants case:label,...`; after `main` its figures are the defaults';
`$OUT/gdpa_tune.json` only), `acts` (our forward with the other
activations and tanh forms, recorded).
"""

import argparse
import json
import os
import pathlib
import sys
import time

from benchmarks import smoke

os.environ["XLA_FLAGS"] = smoke.xla_flags(sys.argv)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from pallas_kernels import schedule
from pallas_kernels.gdpa import mosaic_gpu as mg
from pallas_kernels.gdpa.op import gdpa_mosaic
from pallas_kernels.gdpa.reference import apply_activation, gdpa_reference

B, LQ, N, KH, D = 32, 2048, 8, 2, 128
KV_LENS = (16, 64, 256)
POOLED_Q = 16
LMAX = 2048
DTYPE = jnp.bfloat16
R = 4  # input sets per timed call
TAIL = 64
CUDNN = "cudnn"
INTERPRET = None  # GPU interpret mode under --smoke
SMOKE_SIZES = None
GOALS = {"fwd": 1.6, "fwdbwd": 1.5}
ROOFLINE_GOAL = 0.8
MAX_REL_ERR = 2e-2  # vs the f32 reference, forward and gradients
ACT = "gelu_tanh"
TANH = "exact"  # the op's default tanh form


def capacity(n_rows):
  return -(-(n_rows + TAIL) // 64) * 64


def make_sets(q_off, kv_off, seed):
  t, s = capacity(int(q_off[-1])), capacity(int(kv_off[-1]))
  sets = []
  for r in range(R):
    ks = jax.random.split(jax.random.key(seed * 100 + r), 4)
    q = jax.random.normal(ks[0], (t, N, D), DTYPE)
    k = jax.random.normal(ks[1], (s, KH, D), DTYPE)
    v = jax.random.normal(ks[2], (s, KH, D), DTYPE)
    do = jax.random.normal(ks[3], (t, N, D), DTYPE)
    sets.append((q, k, v, do))
  return sets


def xla_activation_attention(q, k, v, kv_lens, name=ACT):
  """Padded XLA GDPA: `act(scale Q K^T) V`, bf16 operands, f32 accumulate."""
  b, lq, n, h = q.shape
  kh, lk = k.shape[2], k.shape[1]
  qg = q.reshape(b, lq, kh, n // kh, h)
  s = jnp.einsum(
    "blkgh,bmkh->bkglm", qg, k, preferred_element_type=jnp.float32
  ) * (h**-0.5)
  p = apply_activation(s, name)
  valid = jnp.arange(lk)[None, :] < kv_lens[:, None]
  p = jnp.where(valid[:, None, None, None, :], p, 0.0).astype(q.dtype)
  o = jnp.einsum("bkglm,bmkh->blkgh", p, v, preferred_element_type=jnp.float32)
  return o.reshape(b, lq, n, h).astype(q.dtype)


def fwd_bwd(attn):
  """`common.fwd_bwd` (output and gradients, so our forward stays in the
  timed program), jitted once: `time_sets` calls it per input set, and one
  jitted callee lowers once for all of them."""
  return jax.jit(common.fwd_bwd(attn))


def fwd(attn):
  return jax.jit(lambda q, k, v, do: attn(q, k, v))


# An XLA op that reads Q, K and V once and writes an output of O's shape:
# the forward's bytes (`bytes_fwd`) and no other work.
SAME_BYTES = "xla: q + sum(k + v), the forward's bytes"


def same_bytes(q, k, v, do):
  return q + jnp.sum(k + v, dtype=jnp.float32).astype(q.dtype)


def measure_ceilings():
  """(bf16 matmul TFLOP/s, copy TB/s read+write) measured here."""
  if SMOKE_SIZES:
    return 1.0, 1.0
  ab = [
    (jax.random.normal(jax.random.key(i), (8192, 8192), DTYPE),)
    for i in range(2)
  ]
  # Queued and rotating inputs, like every other figure (`time_sets`).
  peak = 2 * 8192**3 / common.time_sets(lambda a: a @ a, ab) / 1e12
  bw = common.copy_bandwidth()
  print(f"ceilings: bf16 matmul {peak:.0f} TFLOP/s, copy {bw:.2f} TB/s")
  return peak, bw


def check(case, ours_fb, q_off, kv_off, sets, max_q, max_kv):
  """Forward and gradients (`ours_fb`, the timed `fwd_bwd` program) vs
  the f32 reference on the first input set."""
  q, k, v, do = sets[0]

  def ref(q, k, v):
    return gdpa_reference(
      q,
      k,
      v,
      q_off,
      kv_off,
      activation=ACT,
      max_len_q=max_q,
      max_len_kv=max_kv,
    )

  errs = common.grad_errs(ours_fb(q, k, v, do), ref, (q, k, v, do))
  print(f"{case}: ours vs f32 reference rel err {errs}", flush=True)
  return errs


def setup(case, q_lens, kv_lens, seed):
  """Inputs and our op for one case (shared by the phases)."""
  q_off, kv_off = common.offsets(q_lens), common.offsets(kv_lens)
  sets = make_sets(q_off, kv_off, seed)
  q_off_j, kv_off_j = jnp.asarray(q_off), jnp.asarray(kv_off)
  max_q, max_kv = int(q_lens.max()), int(kv_lens.max())

  def ours(q, k, v, activation=ACT, tanh=TANH, bs=None):
    # The caller's static bounds: max_len_kv picks the key tile, max_len_q
    # whether a short query side folds its heads into rows (pooled).
    return gdpa_mosaic(
      q,
      k,
      v,
      q_off_j,
      kv_off_j,
      activation=activation,
      tanh=tanh,
      max_len_q=max_q,
      max_len_kv=max_kv,
      block_sizes=bs,
      interpret=INTERPRET,
    )

  return dict(
    case=case,
    q_lens=q_lens,
    kv_lens=kv_lens,
    ours=ours,
    sets=sets,
    flops=4.0 * N * D * float(np.sum(q_lens.astype(np.float64) * kv_lens)),
    bytes_fwd=2.0 * 2 * (q_off[-1] * N * D + kv_off[-1] * KH * D),
    base={},
    q_off=q_off_j,
    kv_off=kv_off_j,
    t=sets[0][0].shape[0],
    max_q=int(q_lens.max()),
    max_kv=max_kv,
  )


def run_xla(ctx, records):
  """Phase main, after every case's main part: the XLA GELU-attention
  baseline (last, so a run cut short loses only it)."""
  kv_lens_j = jnp.asarray(ctx["kv_lens"])

  def xla(q, k, v):
    return xla_activation_attention(q, k, v, kv_lens_j)

  runs = [
    ("xla_gelu", "fwd", fwd(xla), ctx["padded"]),
    ("xla_gelu", "fwdbwd", fwd_bwd(xla), ctx["padded"]),
  ]
  _record_times(ctx, _time_runs(ctx["case"], runs), records)


def run_main(ctx, records, ceilings):
  """Phase main: check, then ours and cuDNN; False when our kernels
  failed the check."""
  case, ours, sets = ctx["case"], ctx["ours"], ctx["sets"]
  q_lens, kv_lens = ctx["q_lens"], ctx["kv_lens"]
  max_q, max_kv = ctx["max_q"], ctx["max_kv"]
  # Correctness first (see `common.checked`), on the program timed below.
  ours_fb = fwd_bwd(ours)
  errs = common.checked(
    "gdpa",
    case,
    lambda: check(
      case, ours_fb, ctx["q_off"], ctx["kv_off"], sets, max_q, max_kv
    ),
    records,
    MAX_REL_ERR,
  )
  q_off, kv_off = common.offsets(q_lens), common.offsets(kv_lens)
  padded = common.padded_sets(sets, q_off, kv_off, max_q, max_kv)
  ctx["padded"] = padded
  cudnn = common.cudnn_padded(q_lens, kv_lens, CUDNN)
  runs = []
  if errs is not None:
    runs += [
      ("mosaic", "fwd", fwd(ours), sets),
      ("mosaic", "fwdbwd", ours_fb, sets),
    ]
  runs += [
    ("cudnn", "fwd", fwd(cudnn), padded),
    ("cudnn", "fwdbwd", fwd_bwd(cudnn), padded),
    (SAME_BYTES, "fwd", jax.jit(same_bytes), sets),
  ]
  times = _time_runs(case, runs)
  copy_like = times.pop((SAME_BYTES, "fwd"), None)
  ctx["times"] = {k: times.get(("mosaic", k)) for k in ("fwd", "fwdbwd")}
  ctx["base"] = {kind: times.get(("cudnn", kind)) for kind in ("fwd", "fwdbwd")}
  _record_times(ctx, times, records)
  peak, bw = ceilings
  flops = ctx["flops"]
  intensity = flops / ctx["bytes_fwd"]  # FLOP per byte
  roof = min(peak, bw * intensity)  # TFLOP/s

  def on_roofline(impl, frac, goal=None):
    records.append(
      common.record(
        "gdpa",
        case,
        impl,
        "fwd_roofline_fraction",
        frac,
        baseline="roofline_tflops",
        baseline_value=roof,
        goal=goal,
        ratio=frac,
      )
    )

  if copy_like is not None and roof < peak:
    # Where the roofline is the bandwidth's, the op that only moves the
    # forward's bytes shows how near it any op gets in practice.
    frac = flops / copy_like / 1e12 / roof
    print(f"{case:12s} {SAME_BYTES}: {frac:.1%} of the roofline", flush=True)
    on_roofline(SAME_BYTES, frac)
  if ("mosaic", "fwd") not in times:
    return False
  achieved = flops / times["mosaic", "fwd"] / 1e12
  print(
    f"{case:12s} roofline {roof:.1f} TFLOP/s (intensity {intensity:.1f} "
    f"FLOP/B): forward at {achieved / roof:.1%}",
    flush=True,
  )
  on_roofline("mosaic", achieved / roof, goal=ROOFLINE_GOAL)
  if ctx["base"]["fwd"] is not None:
    # The forward speed goal restated on the roofline: the fraction of it
    # a forward `GOALS["fwd"]` times as fast as cuDNN's would run at.
    need = GOALS["fwd"] * flops / ctx["base"]["fwd"] / 1e12 / roof
    print(f"{case:12s} the forward goal needs {need:.1%} of it", flush=True)
    on_roofline(f"{GOALS['fwd']}x cudnn_padded", need)
  return errs is not None


def _time_runs(case, runs):
  """Seconds per set of each `(impl, kind, fn, data)`, all timed in
  alternation (`common.time_sets_interleaved`)."""
  t0 = time.perf_counter()
  times = common.time_sets_interleaved(
    {(impl, kind): (fn, data) for impl, kind, fn, data in runs}
  )
  print(
    f"  ({case}: {time.perf_counter() - t0:.1f} s wall, compiles included)",
    flush=True,
  )
  return times


def _record_times(ctx, times, records):
  case, flops, base = ctx["case"], ctx["flops"], ctx["base"]
  for (impl, kind), sec in times.items():
    mult = 3.5 if kind == "fwdbwd" else 1.0
    tf = flops * mult / sec / 1e12
    b_sec = base.get(kind)
    print(
      f"{case:12s} {impl:26s} {kind:7s} {sec * 1e3:8.3f} ms "
      f"{tf:7.1f} useful TFLOP/s",
      flush=True,
    )
    records.append(
      common.record(
        "gdpa",
        case,
        impl,
        f"{kind}_ms",
        sec * 1e3,
        baseline=None if impl == "cudnn" else "cudnn_padded",
        baseline_value=None if impl == "cudnn" or not b_sec else b_sec * 1e3,
        lower_is_better=True,
      )
    )
    if impl != "cudnn" and b_sec:
      # ratio = our useful TFLOP/s over cuDNN's = cuDNN time / our time.
      records.append(
        common.record(
          "gdpa",
          case,
          impl,
          f"{kind}_useful_tflops",
          tf,
          baseline="cudnn_padded",
          baseline_value=flops * mult / b_sec / 1e12,
          goal=GOALS[kind] if impl == "mosaic" else None,
        )
      )


ACTS = {  # label: (activation, tanh); forward only
  "mosaic_gelu": ("gelu", "poly"),
  "mosaic_silu": ("silu", "poly"),
  f"mosaic_{ACT}_poly": (ACT, "poly"),
  f"mosaic_{ACT}_poly_unchecked": (ACT, "poly_unchecked"),
}


def run_acts(ctx, records, labels):
  """Phase 3: our forward with the other activations and tanh forms."""
  ours = ctx["ours"]
  runs = []
  for label in labels:
    act, tanh = ACTS[label]
    fn = lambda q, k, v, do, a=act, th=tanh: ours(q, k, v, a, th)  # noqa: E731
    runs.append((label, "fwd", fn, ctx["sets"]))
  _record_times(ctx, _time_runs(ctx["case"], runs), records)


BS = mg.BlockSizes
FB = ("fwd", "fwdbwd")
F, FWB = ("fwd",), ("fwdbwd",)
DQK = BS(dq_from_ds=False, dq_fused=False)  # the dQ kernel
KV4 = BS(block_kv=64, kv_stages=4)  # 256 keys resident in 64-row tiles
# (case, label, ours' keyword arguments, kinds), in the order they matter
# (the phase stops at its time budget); a case's "default" comes first.
VARIANTS = [
  ("cross256", "default", {}, FB),
  ("cross256", "poly", {"tanh": "poly"}, FB),
  ("cross16", "default", {}, FB),
  ("cross16", "dkv1", {"bs": BS(dkv_split=1)}, FWB),
  ("cross16", "poly", {"tanh": "poly"}, FB),
  ("cross64", "default", {}, FB),
  ("cross64", "dkv1", {"bs": BS(dkv_split=1)}, FWB),
  ("cross64", "poly", {"tanh": "poly"}, F),
  ("cross256", "plain", {"bs": BS(full_store=False)}, F),
  ("cross256", "kv64", {"bs": BS(block_kv=64)}, F),
  ("cross256", "kv64 stages4", {"bs": KV4}, F),
  ("cross256", "poly_unchecked", {"tanh": "poly_unchecked"}, F),
  ("cross256", "dq fused", {"bs": BS(dq_fused=True)}, FWB),
  ("cross64", "dq fused", {"bs": BS(dq_fused=True)}, FWB),
  ("cross16", "dq fused", {"bs": BS(dq_fused=True)}, FWB),
  ("cross256", "dq kernel", {"bs": DQK}, FB),
  ("pooled", "dq kernel", {"bs": DQK}, FWB),
  ("cross64", "ds", {"bs": BS(dq_from_ds=True)}, FWB),
  ("cross16", "ds", {"bs": BS(dq_from_ds=True)}, FWB),
  ("cross256", "dkv2", {"bs": BS(dkv_split=2)}, FWB),
  ("cross256", "dkv_stages3", {"bs": BS(dkv_stages=3)}, FWB),
  ("pooled", "default", {}, FB),
  ("pooled", "nofold", {"bs": BS(fold_heads=False)}, FB),
  ("pooled", "poly", {"tanh": "poly"}, FB),
  ("cross16", "plan (XLA)", None, F),
  ("cross16", "q4", {"bs": BS(q_stages=4)}, F),
  ("cross16", "plain", {"bs": BS(full_store=False)}, F),
  ("cross16", "kv32", {"bs": BS(block_kv=32)}, F),
  ("cross16", "dkv4", {"bs": BS(dkv_split=4)}, FWB),
  ("cross16", "dkv_stages3", {"bs": BS(dkv_stages=3)}, FWB),
  ("cross16", "chunk1", {"bs": BS(deal_chunk=1)}, F),
  ("cross64", "plan (XLA)", None, F),
  ("cross64", "q4", {"bs": BS(q_stages=4)}, F),
  ("cross64", "kv32", {"bs": BS(block_kv=32)}, F),
  ("cross64", "plain", {"bs": BS(full_store=False)}, F),
  ("pooled", "split2", {"bs": BS(kv_split=2)}, F),
  ("pooled", "split4", {"bs": BS(kv_split=4)}, F),
  ("pooled", "dkv2", {"bs": BS(dkv_split=2)}, FWB),
]


def plan_fn(ctx):
  """The XLA part of our forward before the kernel: work list and side
  tiles (`op._query_side` without the kernel)."""
  bkv = mg.kv_block(ctx["max_kv"])

  def plan(q, k, v, do):
    items, _ = schedule.query_items(
      ctx["q_off"], ctx["kv_off"], ctx["t"], block_q=64, block_kv=bkv,
      causal=False,
    )  # fmt: skip
    return (
      items,
      schedule.side_tiles(k, ctx["kv_off"], bkv),
      schedule.side_tiles(v, ctx["kv_off"], bkv),
    )

  return jax.jit(plan)


def run_variants(ctxs, extra, deadline, save, only=None):
  """Phase variants: our forward / forward+backward under other settings
  in one process (`$OUT/gdpa_tune.json`), each with its largest relative
  difference to the default's outputs on the first input set, and the part
  of our forward that is not the kernel (the plan)."""
  by_case = {c["case"]: c for c in ctxs}
  base, outs = {}, {}
  for case, label, kw, kinds in VARIANTS:
    ctx = by_case.get(case)
    if ctx is None or (only and f"{case}:{label}" not in only):
      continue
    for kind in kinds:
      if ctx.get("times", {}).get(kind) and label == "default":
        # Timed by phase main in this process: its figure is the base.
        base[case, kind] = ctx["times"][kind]
        continue
      if time.perf_counter() > deadline:
        print(f"variants: time budget spent, {case} {label} {kind} skipped")
        continue
      if kw is None:
        fn = plan_fn(ctx)
      else:
        op = lambda q, k, v, kw=kw, ours=ctx["ours"]: ours(q, k, v, **kw)  # noqa: E731
        fn = fwd(op) if kind == "fwd" else fwd_bwd(op)
      t0 = time.perf_counter()
      try:
        sec = common.time_sets(fn, ctx["sets"])
      except Exception as e:  # e.g. shared memory overflow
        print(f"{case} {label} {kind}: {type(e).__name__} {str(e)[:300]}")
        continue
      diff = ""
      if kw is not None:  # output (or gradients) vs the default's
        got = jax.tree.leaves(fn(*ctx["sets"][0]))
        if label == "default":
          outs[case, kind] = got
        if (case, kind) not in outs:  # the default's, from phase main
          run = fwd if kind == "fwd" else fwd_bwd
          outs[case, kind] = jax.tree.leaves(run(ctx["ours"])(*ctx["sets"][0]))
        want = outs.get((case, kind))
        if want is not None:
          err = max(map(common.rel_err, got, want))
          diff = f" diff {err:.1e}"
      if label == "default":
        base[case, kind] = sec
      ref = base.get((case, kind))
      vs = f" ({ref / sec:.3f}x default){diff}" if ref else diff
      print(
        f"{case:9s} variant {label:18s} {kind:7s} {sec * 1e3:8.4f} ms{vs} "
        f"[{time.perf_counter() - t0:.1f} s wall]",
        flush=True,
      )
      extra.append(
        {"case": case, "variant": label, "kind": kind, "ms": sec * 1e3}
      )
      save()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--cases", default="cross16,cross64,cross256,pooled")
  parser.add_argument(
    "--phases",
    default="main,xla",
    help="in this order, of: main (ours vs cuDNN), xla (the XLA baseline, "
    "after main: main and xla give every record), "
    "variants (our settings A/B, $OUT/gdpa_tune.json), acts (activations)",
  )
  parser.add_argument("--acts", default=",".join(ACTS), help="phase acts")
  parser.add_argument(
    "--budget", type=float, default=150.0, help="seconds for variants"
  )
  parser.add_argument(
    "--variants", default="", help="case:label,... (default: all)"
  )
  parser.add_argument("--smoke", action="store_true", help="CPU dry run")
  args = parser.parse_args()
  global B, LQ, LMAX, R, CUDNN, INTERPRET, SMOKE_SIZES
  global KV_LENS, POOLED_Q
  if args.smoke:  # tiny shapes, XLA instead of cuDNN, GPU interpret mode
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, LQ, LMAX, R, CUDNN = 2, 70, 150, 1, "xla"
    common.TIMING.update(iters=1, repeats=1, rounds=1)
    KV_LENS, POOLED_Q = (16, 64, 130), 3
    INTERPRET = plgpu.InterpretGPUParams()
    SMOKE_SIZES = True
  start = time.perf_counter()
  print(common.device_name(), jax.__version__, flush=True)
  ceilings = measure_ceilings()
  records, extra, ctxs = [], [], []
  rng = np.random.default_rng(0)
  path = None

  def save():
    # Written after every step: a run cut short keeps what it measured.
    # A smoke run never touches benchmarks/results.
    path = common.write_results("gdpa", records, args.out, dry_run=args.smoke)
    if extra and args.out:
      pathlib.Path(args.out, "gdpa_tune.json").write_text(
        json.dumps(extra, indent=1)
      )
    return path

  for i, case in enumerate(args.cases.split(",")):
    if case.startswith("cross"):
      kv = int(case[len("cross") :])
      if args.smoke:
        kv = {16: 16, 64: 64, 256: 130}[kv]
      q_lens = np.full(B, LQ, np.int32)
      kv_lens = np.full(B, kv, np.int32)
    elif case == "pooled":
      q_lens = np.full(B, POOLED_Q, np.int32)
      kv_lens = common.lognormal_lengths(rng, B, LMAX)
    else:
      raise ValueError(case)
    ctxs.append(setup(case, q_lens, kv_lens, seed=i + 1))
  checked = list(ctxs)
  for phase in args.phases.split(","):
    t0 = time.perf_counter()
    if phase == "main":
      checked = []
      for ctx in ctxs:
        if run_main(ctx, records, ceilings):
          checked.append(ctx)
        path = save()
    elif phase == "xla":
      for ctx in ctxs:
        if "padded" in ctx:
          run_xla(ctx, records)
          path = save()
    elif phase == "variants":
      only = args.variants.split(",") if args.variants else None
      run_variants(ctxs, extra, t0 + args.budget, save, only)
      path = save()
    elif phase == "acts":
      for ctx in checked:
        run_acts(ctx, records, args.acts.split(","))
        path = save()
    else:
      raise ValueError(phase)
    print(f"phase {phase}: {time.perf_counter() - t0:.1f} s", flush=True)
  path = save()
  print(f"wrote {path}; {time.perf_counter() - start:.1f} s in all")


if __name__ == "__main__":
  main()
