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

Also timed, to show where the time goes: the same pipeline moving tiles
without computing ("copy through SMEM"), the forward without residual or
gamma, the backward without dgamma, and a few tile settings.

  PYTHONPATH=. python benchmarks/rms_norm.py [--out DIR] [--sweep]
  PYTHONPATH=. python benchmarks/rms_norm.py --small   # CPU, interpreted
"""

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import common
from pallas_kernels.rms_norm import mosaic_gpu as mg
from pallas_kernels.rms_norm.reference import rms_norm_reference

T = 262_144
DS = (512, 2048)
INTERPRET = False  # --small on CPU: GPU interpret mode, tiny shapes
DTYPE = jnp.bfloat16
GOAL_SPEEDUP = 1.2
# Tile settings tried by --sweep: (pass, (block_rows, warps_per_row, stages,
# num_blocks)); None = the default heuristic. 264 blocks = 2 per SM.
SWEEP = {
  512: [
    ("fwd", (16, 1, 2, 132)),
    ("fwd", (16, 1, 3, 132)),
    ("fwd", (8, 1, 4, 132)),
    ("fwd", (8, 1, 6, 132)),
    ("fwd", (8, 1, 4, 264)),
    ("fwd", (32, 1, 1, 132)),
    ("bwd", (8, 1, 2, 132)),
    ("bwd", (8, 1, 6, 132)),
    ("bwd", (16, 1, 3, 132)),
    ("bwd", (8, 1, 3, 264)),
    ("bwd", (4, 1, 4, 264)),
  ],
  2048: [
    ("fwd", (4, 1, 2, 132)),
    ("fwd", (4, 2, 4, 132)),
    ("fwd", (2, 2, 4, 264)),
    ("fwd", (2, 2, 6, 132)),
    ("bwd", (2, 2, 2, 132)),
    ("bwd", (2, 2, 6, 132)),
    ("bwd", (4, 1, 3, 132)),
    ("bwd", (4, 2, 3, 132)),
    ("bwd", (2, 2, 3, 264)),
  ],
}
GOAL_COPY_FRACTION = 0.9


CALLS, REPEATS = 30, 7


def device_time(fn, arg_sets, *, calls=None, repeats=None) -> float:
  """Median seconds per call on the device.

  `calls` launches are queued back to back (rotating over `arg_sets`) and
  synchronized once, so host dispatch overlaps device work and the launch
  gaps are not counted; the median over `repeats` such batches is returned.
  """
  calls, repeats = calls or CALLS, repeats or REPEATS
  for a in arg_sets:
    jax.block_until_ready(fn(*a))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return float(np.median(times))


def _randn(key, shape, dtype=DTYPE):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def copy_bandwidth(n: int) -> dict:
  """Large device-to-device copies; bytes read + written per second."""
  a = [_randn(jax.random.key(i), (n // 2048, 2048)) for i in range(2)]
  nbytes = 2 * a[0].size * a[0].dtype.itemsize
  out = {}
  copy = jax.jit(lambda x: jnp.copy(x))
  out["xla copy"] = nbytes / device_time(copy, [(x,) for x in a])
  add = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
  out["xla x+1"] = nbytes / device_time(add, [(x,) for x in a])
  return out


def smem_copy(x_td, block_sizes):
  """The kernels' pipeline with the compute left out: tiles in, tiles out."""
  t, d = x_td.shape
  cfg = mg.make_config(
    t, d, x_td.dtype, None, False, 1e-6, block_sizes, INTERPRET, bwd=False
  )

  def kernel(cfg, x_gmem, o_gmem, in_smem, out_smem, barrier):
    def body(row0, ins, store, carry):
      store([plgpu.load(ins[0], layout=cfg.layout)])
      return carry

    mg._pipeline(cfg, [x_gmem], in_smem, barrier, [o_gmem], out_smem)(body, ())

  sds = jax.ShapeDtypeStruct((t, d), x_td.dtype)
  return mg._call(kernel, cfg, [sds], 1, 1, [], x_td)[0]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None, help="also write JSON here")
  ap.add_argument("--sweep", action="store_true", help="time tile settings")
  ap.add_argument("--small", action="store_true", help="tiny run (CPU)")
  args = ap.parse_args()
  global T, INTERPRET, CALLS, REPEATS
  if args.small:
    T, INTERPRET = 1000, jax.default_backend() != "gpu"
    CALLS, REPEATS = 1, 1
  print(jax.devices()[0], jax.__version__)

  # 1 Gi bf16 elements = 2 GiB each way.
  bw = copy_bandwidth(1 << 30 if not args.small else 1 << 20)
  copy_bw = bw["xla copy"]
  print({k: f"{v / 1e12:.3f} TB/s" for k, v in bw.items()})

  records, rows, extra = [], [], {"copy_bw": bw}
  for d in DS:
    key = jax.random.key(d)
    ks = jax.random.split(key, 12)
    sets = []
    for i in range(2):
      x = _randn(ks[6 * i], (T, d))
      r = _randn(ks[6 * i + 1], (T, d))
      g = (1 + 0.1 * _randn(ks[6 * i + 2], (d,), jnp.float32)).astype(DTYPE)
      dy = _randn(ks[6 * i + 3], (T, d))
      dh = _randn(ks[6 * i + 4], (T, d))
      sets.append((x, r, g, dy, dh))
    tensor = T * d * 2
    case = f"T={T} D={d} bf16 residual+gamma"

    def fwd_cfg(bs, gamma=True, residual=True, d=d):
      return mg.make_config(
        T,
        d,
        DTYPE,
        DTYPE if gamma else None,
        residual,
        1e-6,
        bs,
        INTERPRET,
        bwd=False,
      )

    def bwd_cfg(bs, gamma=True, residual=True, d=d):
      return mg.make_config(
        T,
        d,
        DTYPE,
        DTYPE if gamma else None,
        residual,
        1e-6,
        bs,
        INTERPRET,
        bwd=True,
      )

    def ours_fwd(cfg):
      return jax.jit(
        lambda xa, ra, ga: mg.rms_norm_fwd(
          xa,
          ga if cfg.gamma_dtype else None,
          ra if cfg.has_residual else None,
          cfg,
        )
      )

    def ours_bwd(cfg):
      return jax.jit(
        lambda ha, ga, dya, dha: mg.rms_norm_bwd(
          ha,
          dya,
          dha if cfg.has_residual else None,
          ga if cfg.gamma_dtype else None,
          cfg,
        )
      )

    fwd_args = [(x, r, g) for x, r, g, _, _ in sets]
    bwd_args = [(x, g, dy, dh) for x, _, g, dy, dh in sets]

    # Correctness at the benchmark shape before timing.
    x, r, g, dy, dh = sets[0]
    cf, cb = fwd_cfg(None), bwd_cfg(None)
    y, h = ours_fwd(cf)(x, r, g)
    y_ref, h_ref = rms_norm_reference(x, g, r)
    dxo, dgo = ours_bwd(cb)(h, g, dy, dh)
    _, vjp_ref = jax.vjp(lambda x, g, r: rms_norm_reference(x, g, r), x, g, r)
    dx_ref, dg_ref, _ = vjp_ref((dy, dh))

    def rel(a, b):
      a = jnp.asarray(a, jnp.float32)
      b = jnp.asarray(b, jnp.float32)
      return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    errs = {
      "y": rel(y, y_ref),
      "h": rel(h, h_ref),
      "dx": rel(dxo, dx_ref),
      "dgamma": rel(dgo, dg_ref),
    }
    print(d, "relative errors", errs)
    extra[f"errors_d{d}"] = errs
    assert all(e < 2e-2 for e in errs.values()), errs

    xla_fwd = jax.jit(lambda x, r, g: rms_norm_reference(x, g, r))
    xla_bwd = jax.jit(
      lambda x, g, dy, dh, r: jax.vjp(
        lambda x, g, r: rms_norm_reference(x, g, r), x, g, r
      )[1]((dy, dh))
    )
    t_xla_fwd = device_time(xla_fwd, fwd_args)
    t_xla_bwd = device_time(
      xla_bwd, [(x, g, dy, dh, r) for x, r, g, dy, dh in sets]
    )
    t_fwd = device_time(ours_fwd(cf), fwd_args)
    t_bwd = device_time(ours_bwd(cb), bwd_args)

    fwd_bytes = 4 * tensor + d * 2
    bwd_bytes = 4 * tensor + d * 2 + cb.num_blocks * cb.block_rows * d * 4
    timings = {
      "fwd": (t_fwd, fwd_bytes, cf),
      "bwd": (t_bwd, bwd_bytes, cb),
    }
    for name, (t_ours, nbytes, cfg) in timings.items():
      t_xla = t_xla_fwd if name == "fwd" else t_xla_bwd
      rows.append(
        dict(
          d=d,
          pass_=name,
          ours_ms=t_ours * 1e3,
          xla_ms=t_xla * 1e3,
          speedup=t_xla / t_ours,
          tbps=nbytes / t_ours / 1e12,
          copy_fraction=nbytes / t_ours / copy_bw,
          block_rows=cfg.block_rows,
          stages=cfg.stages,
          num_blocks=cfg.num_blocks,
        )
      )
      records.append(
        common.record(
          "rms_norm",
          f"{case} {name}",
          "mosaic",
          "ms",
          t_ours * 1e3,
          baseline="xla (jit of reference"
          + (")" if name == "fwd" else " VJP)"),
          baseline_value=t_xla * 1e3,
          lower_is_better=True,
          goal=None,
        )
      )
      records.append(
        common.record(
          "rms_norm",
          f"{case} {name}",
          "mosaic",
          "speedup vs xla",
          t_xla / t_ours,
          goal=GOAL_SPEEDUP,
        )
      )
      records.append(
        common.record(
          "rms_norm",
          f"{case} {name}",
          "mosaic",
          "TB/s",
          nbytes / t_ours / 1e12,
          baseline="device copy",
          baseline_value=copy_bw / 1e12,
        )
      )
      records.append(
        common.record(
          "rms_norm",
          f"{case} {name}",
          "mosaic",
          "fraction of copy bw",
          nbytes / t_ours / copy_bw,
          goal=GOAL_COPY_FRACTION,
        )
      )

    # Where the time goes: stages left out (same tiles as the default).
    parts = {}
    xs = [(s[0],) for s in sets]
    cp = jax.jit(lambda x: smem_copy(x, None))
    parts["copy through SMEM (x->y, no compute)"] = (
      device_time(cp, xs),
      2 * tensor,
    )
    parts["fwd no residual (x->y)"] = (
      device_time(ours_fwd(fwd_cfg(None, residual=False)), fwd_args),
      2 * tensor,
    )
    parts["fwd no gamma"] = (
      device_time(ours_fwd(fwd_cfg(None, gamma=False)), fwd_args),
      4 * tensor,
    )
    parts["bwd no gamma (no dgamma)"] = (
      device_time(ours_bwd(bwd_cfg(None, gamma=False)), bwd_args),
      4 * tensor,
    )
    parts["bwd no residual"] = (
      device_time(ours_bwd(bwd_cfg(None, residual=False)), bwd_args),
      3 * tensor,
    )
    parts["xla copy of x"] = (
      device_time(jax.jit(lambda x: jnp.copy(x)), xs),
      2 * tensor,
    )
    for k, (t_, nb) in parts.items():
      print(
        f"  D={d} {k:42s} {t_ * 1e3:7.3f} ms {nb / t_ / 1e12:6.3f} TB/s"
        f" ({nb / t_ / copy_bw:.0%} of copy)"
      )
    extra[f"parts_d{d}"] = {
      k: (t_ * 1e3, nb / t_ / 1e12) for k, (t_, nb) in parts.items()
    }

    if args.sweep:
      sweep = []
      for name, (rows_, wpr, stages, nb) in SWEEP[d]:
        bs = mg.BlockSizes(
          block_rows=rows_, warps_per_row=wpr, stages=stages, num_blocks=nb
        )
        mk, run, a = {
          "fwd": (fwd_cfg, ours_fwd, fwd_args),
          "bwd": (bwd_cfg, ours_bwd, bwd_args),
        }[name]
        cfg = mk(bs)
        smem = mg.smem_bytes(cfg, bwd=name == "bwd")
        label = (
          f"D={d} {name} rows={cfg.block_rows} wpr={wpr} "
          f"stages={cfg.stages} blocks={cfg.num_blocks} "
          f"smem={smem // 1024}K"
        )
        if smem * (nb // 132) > 220 * 1024:
          print("  sweep", label, "skipped: shared memory")
          continue
        try:
          t_ = device_time(run(cfg), a)
        except Exception as e:  # noqa: BLE001 - report and go on
          print("  sweep", label, "failed:", type(e).__name__, str(e)[:300])
          continue
        nbytes = 4 * tensor
        sweep.append(dict(label=label, ms=t_ * 1e3, tbps=nbytes / t_ / 1e12))
        print(
          f"  sweep {label}: {t_ * 1e3:.3f} ms {nbytes / t_ / 1e12:.3f} TB/s"
        )
      extra[f"sweep_d{d}"] = sweep

  print()
  print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write)")
  print("D    pass ours_ms xla_ms speedup TB/s  copy%  rows stages blocks")
  for r in rows:
    print(
      f"{r['d']:<4} {r['pass_']:4} {r['ours_ms']:7.3f} {r['xla_ms']:6.3f}"
      f" {r['speedup']:6.2f}x {r['tbps']:5.2f} {r['copy_fraction']:5.0%}"
      f" {r['block_rows']:5} {r['stages']:6} {r['num_blocks']:6}"
    )
  if args.small:  # a smoke run: print, but keep the real results file
    common.print_table(records)
    return
  common.write_results("rms_norm", records, out_dir=args.out)
  if args.out:
    p = pathlib.Path(args.out) / "rms_norm_details.json"
    p.write_text(json.dumps(dict(rows=rows, **extra), indent=1, default=str))


if __name__ == "__main__":
  main()
