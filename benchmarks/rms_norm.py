"""Fused RMSNorm (O11) against XLA's fusion of the reference, on one GPU.

Case: T=262,144 rows, D=512 and D=2,048, bf16, with residual and gamma.
  forward:  ours = Mosaic GPU kernel; XLA = jit(rms_norm_reference).
  backward: ours = backward kernel given the saved h (plus the small dgamma
            partial sum); XLA = jit of the reference's VJP (recomputes what
            it needs from x and residual, as a training step would).
Bandwidth counts each tensor read or written once: forward reads x,
residual and writes y, h (4·T·D·2 bytes); backward reads h, dy, dh_out and
writes dh (4·T·D·2 bytes); gamma and the dgamma partials are added too.
The ceiling is a device-to-device copy measured in the same process
(bytes read + written).
Each of our kernels is timed in alternation with XLA's (7 rounds of
`common.device_time` with 30 calls for each; `common.time_interleaved`) and
the speedup is the ratio of the two medians.

The forward with its output also quantized for an FP8 matmul (e4m3 values
and a power-of-two scale per 1x128 block, G4; --fp8, also part of a full
run): ours fused in the one kernel, against our kernel followed by the
quantize kernel (what the op did before it fused) and XLA's reference with
its quantization; bytes are the forward's plus the values (1 byte each) and
scales. With --variants, fused tile settings too (`FP8_VARIANTS`).

Also timed, to show where the time goes (--parts): the same pipeline moving
tiles without computing ("copy through SMEM"), the forward without
residual, XLA's copy of x; with --variants, forward pipeline variants
(`VARIANTS`: output slots, stages, PDL, direct loads, tile sizes, ...)
recorded as their own impls, and the copy through each pipeline.

  PYTHONPATH=. python benchmarks/rms_norm.py [--out DIR] [--parts]
      [--variants] [--sweep] [--fp8] [--ds 512,2048]
  PYTHONPATH=. python benchmarks/rms_norm.py --small   # CPU, interpreted
"""

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks import common
from pallas_kernels import fp8, mosaic
from pallas_kernels.rms_norm import mosaic_gpu as mg
from pallas_kernels.rms_norm import mosaic_gpu_pipeline as pipe
from pallas_kernels.rms_norm.mosaic_gpu_bwd import rms_norm_bwd
from pallas_kernels.rms_norm.mosaic_gpu_fwd import rms_norm_fwd
from pallas_kernels.rms_norm.reference import rms_norm_reference

T = 262_144
DS = (512, 2048)
INTERPRET = False  # --small on CPU: GPU interpret mode, tiny shapes
DTYPE = jnp.bfloat16
GOAL_SPEEDUP = 1.2
# Tile settings tried by --sweep: (pass, (block_rows, warps_per_row, stages,
# num_blocks, direct_stores)). 264 blocks = 2 per SM. (Earlier sweeps:
# docs/kernels/rms_norm.md.)
SWEEP = {
  512: [
    ("fwd", (16, 1, 2, 132, True)),
    ("fwd", (16, 1, 5, 132, True)),
    ("fwd", (32, 1, 2, 132, True)),
    ("fwd", (8, 1, 4, 264, True)),
    ("bwd", (8, 1, 6, 132, True)),
    ("bwd", (4, 1, 4, 264, True)),
  ],
  2048: [
    ("fwd", (4, 1, 2, 132, True)),
    ("fwd", (4, 2, 4, 132, True)),
    ("fwd", (2, 2, 4, 264, True)),
    ("bwd", (2, 2, 6, 132, True)),
    ("bwd", (2, 2, 3, 264, True)),
  ],
}
GOAL_COPY_FRACTION = 0.9


CALLS, REPEATS = 30, 7


def device_time(fn, arg_sets) -> float:
  return common.device_time(fn, arg_sets, calls=CALLS, repeats=REPEATS)


def _randn(key, shape, dtype=DTYPE):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def copy_bandwidth(n: int) -> dict:
  """`common.copy_bandwidths` of `n`-element bf16 arrays, in bytes/s."""
  bws = common.copy_bandwidths(2 * n, calls=CALLS, repeats=REPEATS)
  return {k: v * 1e12 for k, v in bws.items()}


def smem_copy(x_td, block_sizes):
  """The kernels' pipeline with the compute left out: tiles in, tiles out."""
  t, d = x_td.shape
  cfg = mg.make_config(
    t, d, x_td.dtype, None, False, 1e-6, block_sizes, INTERPRET, bwd=False
  )

  def kernel(cfg, x_gmem, o_gmem, in_smem, out_smem, barrier):
    pipe.prologue(cfg)

    def body(row0, load, store, carry):
      store([load(0)])
      return carry

    pipe.pipeline(cfg, [x_gmem], in_smem, barrier, [o_gmem], out_smem)(body, ())

  sds = jax.ShapeDtypeStruct((t, d), x_td.dtype)
  return pipe.launch(kernel, cfg, [sds], 1, 1, [], x_td)[0]


class Case:
  """Inputs (two rotating sets) and kernel builders for one width `d`."""

  def __init__(self, d: int):
    self.d = d
    self.tensor = T * d * 2  # bytes of one [T, d] bf16 tensor
    ks = jax.random.split(jax.random.key(d), 12)
    self.sets = []
    for i in range(2):
      x = _randn(ks[6 * i], (T, d))
      r = _randn(ks[6 * i + 1], (T, d))
      g = (1 + 0.1 * _randn(ks[6 * i + 2], (d,), jnp.float32)).astype(DTYPE)
      dy = _randn(ks[6 * i + 3], (T, d))
      dh = _randn(ks[6 * i + 4], (T, d))
      self.sets.append((x, r, g, dy, dh))
    self.fwd_args = [(x, r, g) for x, r, g, _, _ in self.sets]
    self.bwd_args = [(x, g, dy, dh) for x, _, g, dy, dh in self.sets]

  def cfg(self, bs, *, bwd, gamma=True, residual=True):
    gamma_dtype = DTYPE if gamma else None
    return mg.make_config(
      T, self.d, DTYPE, gamma_dtype, residual, 1e-6, bs, INTERPRET, bwd=bwd
    )

  @staticmethod
  def fwd(cfg):
    def f(x, r, g):
      g = g if cfg.gamma_dtype else None
      return rms_norm_fwd(x, g, r if cfg.has_residual else None, cfg)

    return jax.jit(f)

  @staticmethod
  def bwd(cfg):
    def f(h, g, dy, dh):
      g = g if cfg.gamma_dtype else None
      return rms_norm_bwd(h, dy, dh if cfg.has_residual else None, g, cfg)

    return jax.jit(f)


def _rel(a, b) -> float:
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def check(c: Case) -> dict:
  """Values and gradients at the benchmark shape, before timing."""
  x, r, g, dy, dh = c.sets[0]
  y, h = c.fwd(c.cfg(None, bwd=False))(x, r, g)
  y_ref, h_ref = rms_norm_reference(x, g, r)
  dx, dg = c.bwd(c.cfg(None, bwd=True))(h, g, dy, dh)
  _, vjp_ref = jax.vjp(rms_norm_reference, x, g, r)
  dx_ref, dg_ref, _ = vjp_ref((dy, dh))
  errs = {
    "y": _rel(y, y_ref),
    "h": _rel(h, h_ref),
    "dx": _rel(dx, dx_ref),
    "dgamma": _rel(dg, dg_ref),
  }
  print(f"D={c.d} relative errors", errs)
  assert all(e < 2e-2 for e in errs.values()), errs
  return errs


B = mg.BlockSizes
F, FB = ("fwd",), ("fwd", "bwd")
# Pipeline variants timed by --variants, recorded as their own impls:
# name -> (BlockSizes, passes). What the runs of earlier lists found, and
# which variants became defaults: docs/kernels/rms_norm.md.
VARIANTS = {
  "SMEM ring (the default over 1 KiB rows)": (B(direct_loads=False), F),
  "ring, 2 output slots, 4 stages (run 3 default)": (
    B(direct_loads=False, out_slots=2, max_stages=4),
    F,
  ),
  "ring, 3 output slots, 2 stages": (B(direct_loads=False, out_slots=3), F),
  "ring, 2 output slots, 2 stages": (B(direct_loads=False, out_slots=2), F),
  "ring, 6 output slots, 2 stages": (B(direct_loads=False, out_slots=6), F),
  "ring, 4 output slots, 3 stages": (B(direct_loads=False, max_stages=3), F),
  "no PDL": (B(pdl=False), FB),
  "direct loads, 132 blocks": (B(direct_loads=True), F),
  "direct loads, 264 blocks": (B(direct_loads=True, num_blocks=264), F),
  "ring, 24 KiB tiles, 2 warps per row, 2 output slots": (
    B(
      direct_loads=False,
      warps_per_row=2,
      tile_bytes=24 * 1024,
      out_slots=2,
    ),
    F,
  ),
  "ring, 2 blocks per SM, 8 KiB tiles, 2 warps per row": (
    B(
      direct_loads=False,
      num_blocks=264,
      tile_bytes=8 * 1024,
      warps_per_row=2,
      balance=False,
    ),
    F,
  ),
}
# Fused FP8 output settings timed by --fp8 --variants, against the default.
FP8_VARIANTS = {
  "fused, 2 stages": B(max_stages=2),
  "fused, 8 KiB tiles": B(tile_bytes=8 * 1024),
  "fused, 32 KiB tiles": B(tile_bytes=32 * 1024),
  "fused, 3 output slots, 2 stages": B(out_slots=3, max_stages=2),
}
# The same pipelines moving x -> y without compute (D=2048's 2.1 GB).
COPY_VARIANTS = {
  "ring, no PDL, no balance": B(direct_loads=False, pdl=False, balance=False),
  "ring": B(direct_loads=False),
  "direct loads, 264 blocks": B(direct_loads=True, num_blocks=264),
}


def _timed(c: Case, name: str, bs, copy_bw: float, xla):
  """Ours with `bs` (None = defaults) timed in alternation with `xla[name]`
  (`(fn, arg_sets)`, `common.time_interleaved`): a table row, our seconds
  and XLA's."""
  d, tensor = c.d, c.tensor
  cfg = c.cfg(bs, bwd=name == "bwd")
  smem = mg.smem_bytes(cfg, bwd=name == "bwd")
  if smem * pl.cdiv(cfg.num_blocks, mosaic.num_sms()) > 220 * 1024:
    raise ValueError(f"{smem // 1024} KiB of SMEM per block: no co-residence")
  if name == "fwd":
    ours = (c.fwd(cfg), c.fwd_args)
    nb = 4 * tensor + d * 2
  else:
    ours = (c.bwd(cfg), c.bwd_args)
    nb = 4 * tensor + d * 2 + cfg.num_blocks * cfg.block_rows * d * 4
  times = common.time_interleaved(
    {"ours": ours, "xla": xla[name]}, rounds=REPEATS, calls=CALLS
  )
  t = times["ours"]
  row = dict(
    d=d,
    pass_=name,
    ours_ms=t * 1e3,
    tbps=nb / t / 1e12,
    copy_fraction=nb / t / copy_bw,
    block_rows=cfg.block_rows,
    warps_per_row=cfg.warps_per_row,
    stages=cfg.stages,
    num_blocks=cfg.num_blocks,
    smem_kib=smem // 1024,
  )
  return row, t, nb, times["xla"]


def measure(
  c: Case, copy_bw: float, records: list, rows: list, variants: dict
) -> None:
  """Ours (defaults, then each of `variants`) vs XLA, each pair timed in
  alternation: a sustained run heats the chip and moves the clock, so
  timing all of one program's batches before the other's compares them at
  different clock states (`common.time_interleaved`)."""
  d = c.d
  case = f"T={T} D={d} bf16 residual+gamma"
  xla_fwd = jax.jit(lambda x, r, g: rms_norm_reference(x, g, r))

  def xla_vjp(x, g, dy, dh, r):
    return jax.vjp(rms_norm_reference, x, g, r)[1]((dy, dh))

  xla = {
    "fwd": (xla_fwd, c.fwd_args),
    "bwd": (
      jax.jit(xla_vjp),
      [(x, g, dy, dh, r) for x, r, g, dy, dh in c.sets],
    ),
  }
  _two_in_two_out(c, case, device_time(*xla["fwd"]), copy_bw, records)
  baseline = {"fwd": "xla: jit(reference)", "bwd": "xla: jit(reference VJP)"}
  runs = [("mosaic (default)", None, ("fwd", "bwd"))]
  runs += [(f"mosaic, {k}", bs, p) for k, (bs, p) in variants.items()]
  for impl, bs, passes in runs:
    for name in passes:
      try:
        row, t, nb, tx = _timed(c, name, bs, copy_bw, xla)
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  D={d} {name} {impl} FAILED:", type(e).__name__, str(e)[:300])
        continue
      row.update(impl=impl, xla_ms=tx * 1e3, speedup=tx / t)
      rows.append(row)
      print(
        f"  D={d} {name} {impl:44s} {t * 1e3:7.4f} ms {tx / t:5.3f}x"
        f" {row['copy_fraction']:6.1%} of copy (rows {row['block_rows']},"
        f" stages {row['stages']}, blocks {row['num_blocks']},"
        f" smem {row['smem_kib']}K)",
        flush=True,
      )
      rec = functools.partial(common.record, "rms_norm", f"{case} {name}", impl)
      records += [
        rec(
          "ms",
          t * 1e3,
          baseline=baseline[name],
          baseline_value=tx * 1e3,
          lower_is_better=True,
        ),
        rec(
          "speedup vs xla",
          tx / t,
          baseline=baseline[name],
          goal=GOAL_SPEEDUP,
        ),
        rec(
          "TB/s",
          nb / t / 1e12,
          baseline="device copy TB/s",
          baseline_value=copy_bw / 1e12,
          goal=GOAL_COPY_FRACTION,  # bounds the ratio: fraction of copy
        ),
      ]


def measure_fp8(c: Case, copy_bw: float, records: list, variants: dict):
  """The forward with the FP8 output (1x128 blocks), fused, against our
  kernel then the quantize kernel, and XLA's reference with quantization;
  all timed in alternation. Checks first that the fused values and scales
  are those of quantizing the fused kernel's own `y`."""
  d = c.d
  case = f"T={T} D={d} bf16 residual+gamma fwd+fp8"

  def fused_fn(bs):
    cfg = mg.make_config(
      T, d, DTYPE, DTYPE, True, 1e-6, bs, INTERPRET, bwd=False, quantize=True
    )
    return jax.jit(lambda x, r, g: rms_norm_fwd(x, g, r, cfg))

  plain = c.cfg(None, bwd=False)

  def unfused(x, r, g):
    y, h = rms_norm_fwd(x, g, r, plain)
    q = fp8.quantize(y, axis=1, implementation="mosaic")
    return y, h, q.values, q.scales

  def xla(x, r, g):
    yq, h = rms_norm_reference(x, g, r, quantize="deepseek")
    return yq.source, h, yq.values, yq.scales

  fused = fused_fn(None)
  x, r, g = c.fwd_args[0]
  y, _, v, sc = fused(x, r, g)
  again = fp8.quantize(y, axis=1, implementation="xla")
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  same = {
    "values equal": float(jnp.mean(f32(v) == f32(again.values))),
    "scales equal": float(jnp.mean(sc == again.scales)),
  }
  print(f"  D={d} fp8 output:", same)
  for metric, value in same.items():
    records.append(
      common.record("rms_norm", case, "mosaic fused", metric, value)
    )
  runs = {
    "mosaic fused (default)": (fused, c.fwd_args),
    "mosaic norm, then quantize kernel": (jax.jit(unfused), c.fwd_args),
    "xla: jit(reference, quantize)": (jax.jit(xla), c.fwd_args),
  }
  runs |= {k: (fused_fn(bs), c.fwd_args) for k, bs in variants.items()}
  times = common.time_interleaved(
    runs, rounds=REPEATS, calls=CALLS, skip_failures=True
  )
  nb = 4 * c.tensor + d * 2 + T * d + T * (d // 128) * 4
  t_un = times["mosaic norm, then quantize kernel"]
  t_x = times["xla: jit(reference, quantize)"]
  for impl, t in times.items():
    rec = functools.partial(common.record, "rms_norm", case, impl)
    print(
      f"  D={d} fwd+fp8 {impl:40s} {t * 1e3:7.4f} ms"
      f" {nb / t / copy_bw:6.1%} of copy, {t_un / t:5.3f}x unfused,"
      f" {t_x / t:5.3f}x xla",
      flush=True,
    )
    records.append(rec("ms", t * 1e3, lower_is_better=True))
    records.append(
      rec(
        "TB/s",
        nb / t / 1e12,
        baseline="device copy TB/s",
        baseline_value=copy_bw / 1e12,
      )
    )
    if impl.startswith("mosaic fused"):
      records.append(
        rec(
          "speedup vs unfused",
          t_un / t,
          baseline="mosaic norm, then quantize kernel",
        )
      )
      records.append(
        rec("speedup vs xla", t_x / t, baseline="xla: jit(reference, quantize)")
      )


def _two_in_two_out(c: Case, case: str, t_ref: float, copy_bw, records):
  """The forward's traffic (read x and the residual, write y and h: four
  `[T, D]` tensors) moved by XLA's simplest elementwise kernel,
  `(x + r, x - r)`: what the memory system gives that pattern, and so the
  speedup over XLA's RMSNorm a forward would have if it ran at that rate
  (its time per byte)."""
  nb = 4 * c.tensor
  t = device_time(jax.jit(lambda x, r, g: (x + r, x - r)), c.fwd_args)
  name = "xla: (x + r, x - r), the forward's bytes"
  print(
    f"  D={c.d} fwd {name:44s} {t * 1e3:7.4f} ms {t_ref / t:5.3f}x"
    f" {nb / t / copy_bw:6.1%} of copy",
    flush=True,
  )
  rec = functools.partial(common.record, "rms_norm", f"{case} fwd", name)
  records += [
    rec(
      "TB/s",
      nb / t / 1e12,
      baseline="device copy TB/s",
      baseline_value=copy_bw / 1e12,
    ),
    rec("speedup vs xla", t_ref / t, baseline="xla: jit(reference)"),
  ]


def parts(c: Case, copy_bw: float, copy_variants: dict) -> dict:
  """Where the time goes: the same tiles with a stage left out, and the
  pipeline variants moving x -> y without compute."""
  d, tensor = c.d, c.tensor
  xs = [(s[0],) for s in c.sets]
  variants = {
    f"copy through SMEM, {k} (x->y)": (
      jax.jit(functools.partial(smem_copy, block_sizes=bs)),
      xs,
      2 * tensor,
    )
    for k, bs in copy_variants.items()
  }
  variants |= {
    "fwd without residual (x->y)": (
      c.fwd(c.cfg(None, bwd=False, residual=False)),
      c.fwd_args,
      2 * tensor,
    ),
    "xla copy of x": (jax.jit(lambda x: jnp.copy(x)), xs, 2 * tensor),
  }
  out = {}
  for k, (fn, a, nb) in variants.items():
    try:
      t = device_time(fn, a)
    except Exception as e:  # noqa: BLE001 - report and go on
      print(f"  D={d} {k} FAILED:", type(e).__name__, str(e)[:300])
      continue
    out[k] = dict(ms=t * 1e3, tbps=nb / t / 1e12, copy=nb / t / copy_bw)
    print(
      f"  D={d} {k:50s} {t * 1e3:7.4f} ms {nb / t / 1e12:6.3f} TB/s"
      f" ({nb / t / copy_bw:.1%} of copy)",
      flush=True,
    )
  return out


def sweep(c: Case) -> list:
  """Tile settings of `SWEEP[d]`, four tensors' bytes per pass."""
  results = []
  for name, (rows_, wpr, stages, nb, direct) in SWEEP[c.d]:
    bs = mg.BlockSizes(
      block_rows=rows_,
      warps_per_row=wpr,
      stages=stages,
      num_blocks=nb,
      direct_stores=direct,
    )
    cfg = c.cfg(bs, bwd=name == "bwd")
    smem = mg.smem_bytes(cfg, bwd=name == "bwd")
    label = (
      f"D={c.d} {name} rows={cfg.block_rows} wpr={cfg.warps_per_row} "
      f"stages={cfg.stages} blocks={cfg.num_blocks} smem={smem // 1024}K"
      f" direct={cfg.direct_stores}"
    )
    if smem * (nb // 132) > 220 * 1024:
      print("  sweep", label, "skipped: shared memory")
      continue
    fn, args = (
      (c.fwd(cfg), c.fwd_args)
      if name == "fwd"
      else (
        c.bwd(cfg),
        c.bwd_args,
      )
    )
    try:
      t = device_time(fn, args)
    except Exception as e:  # noqa: BLE001 - report and go on
      print("  sweep", label, "failed:", type(e).__name__, str(e)[:300])
      continue
    tbps = 4 * c.tensor / t / 1e12
    results.append(dict(label=label, ms=t * 1e3, tbps=tbps))
    print(f"  sweep {label}: {t * 1e3:.3f} ms {tbps:.3f} TB/s")
  return results


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None, help="also write JSON here")
  ap.add_argument("--sweep", action="store_true", help="time tile settings")
  ap.add_argument("--parts", action="store_true", help="stages left out")
  ap.add_argument(
    "--variants", action="store_true", help="forward pipeline variants"
  )
  ap.add_argument("--small", action="store_true", help="tiny run (CPU)")
  ap.add_argument(
    "--fp8", action="store_true", help="only the forward with FP8 output"
  )
  ap.add_argument("--ds", default=None, help="widths, e.g. 512,2048")
  args = ap.parse_args()
  global T, DS, INTERPRET, CALLS, REPEATS
  if args.ds:
    DS = tuple(int(d) for d in args.ds.split(","))
  if args.small:
    T, DS, INTERPRET = 100, (512,), jax.default_backend() != "gpu"
    CALLS, REPEATS = 1, 1
  print(jax.devices()[0], jax.__version__)
  details = {}

  def save():
    if args.out:
      p = pathlib.Path(args.out) / "rms_norm_details.json"
      p.parent.mkdir(parents=True, exist_ok=True)
      p.write_text(json.dumps(details, indent=1, default=str))

  # 1 Gi bf16 elements = 2 GiB each way.
  bw = copy_bandwidth(1 << 30 if not args.small else 1 << 20)
  copy_bw = bw["xla copy"]
  print({k: f"{v / 1e12:.3f} TB/s" for k, v in bw.items()})
  details["copy_bw"] = bw

  records = [
    common.record(
      "rms_norm",
      "device copy, 2 GiB bf16",
      "xla: jnp.copy",
      "TB/s",
      copy_bw / 1e12,
    )
  ]
  rows = []
  for d in DS:
    c = Case(d)
    details[f"errors_d{d}"] = check(c)
    if not args.fp8:
      measure(c, copy_bw, records, rows, VARIANTS if args.variants else {})
    measure_fp8(c, copy_bw, records, FP8_VARIANTS if args.variants else {})
    if args.parts:
      # The copy variants at the larger size only (the one the fit of
      # fixed vs streaming cost leans on).
      copies = {"ring": B(direct_loads=False)}
      if args.variants and d == max(DS):
        copies = COPY_VARIANTS
      details[f"parts_d{d}"] = parts(c, copy_bw, copies)
    details["records"] = records
    details["rows"] = rows
    save()
    del c

  print()
  print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write)")
  print(
    "D    pass impl                                          ours_ms xla_ms"
    " speedup TB/s  copy%  rows wpr stages blocks"
  )
  for r in rows:
    print(
      f"{r['d']:<4} {r['pass_']:4} {r['impl']:44} {r['ours_ms']:7.4f}"
      f" {r['xla_ms']:6.4f}"
      f" {r['speedup']:6.3f}x {r['tbps']:5.3f} {r['copy_fraction']:6.1%}"
      f" {r['block_rows']:5} {r['warps_per_row']:3} {r['stages']:6}"
      f" {r['num_blocks']:6}"
    )
  # A --small smoke run never touches benchmarks/results.
  common.write_results(
    "rms_norm", records, out_dir=args.out, dry_run=args.small
  )

  if args.sweep:
    for d in DS:
      details[f"sweep_d{d}"] = sweep(Case(d))
      save()


if __name__ == "__main__":
  main()
