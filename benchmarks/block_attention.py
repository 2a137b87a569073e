"""Block attention (G3): our Mosaic GPU kernels vs cuDNN on the batch cut
into blocks, and vs sliding-window attention.

    PYTHONPATH=. python3 benchmarks/block_attention.py [--out DIR]
        [--mixes all2048,lognormal] [--parts] [--block 64] [--smoke]

B=32 sequences, D=128, 8 query heads over 2 KV heads (the model's GQA),
bf16, blocks of 64 with RoPE (theta 10,000) applied inside the op; lengths
(a) all 2,048, (b) log-normal (median 1,100, sigma 0.6, capped at 2,048).
In one process:
- ours: `block_attention(block=64, rope=theta)` on the packed buffer;
- cuDNN on the batch reshaped into blocks: every non-empty 64-position
  block of every sequence as one row of a `[blocks, 64, n, h]` batch (the
  gather is made outside the timed call, zero-padded last blocks with
  per-block lengths), XLA RoPE on that layout inside the timed call, then
  `jax.nn.dot_product_attention(implementation="cudnn")`;
- sliding window (window 64 each side, the seed's previous step, RoPE
  included): `sliding_window_attention`, XLA RoPE then our jagged
  attention kernel with its `window` (each 64-row query tile visits only
  the key tiles its rows' windows reach); and the XLA banded implementation
  `sliding_window_reference` as `sliding_window_xla` (cuDNN rejects a
  non-causal (64, 64) window, BASELINES.md). The window kernel's forward
  and gradients are checked against the f32 banded reference first.
All four are timed in alternation, 7 rounds, medians
(`common.time_sets_interleaved`).
Useful FLOPs (`4 n h` per real query-key pair; x3.5 forward+backward) are
counted per op, so "useful TFLOP/s" is MFU-like (the seed's +44% over the
sliding window is an MFU ratio). The op is memory-bound, so the forward is
also reported as a fraction of the copy bandwidth measured here (bytes = Q,
K, V, O once). Goals (issue 4): forward and forward+backward >= 1.5x the
cuDNN-blocks baseline, forward >= 80% of copy bandwidth, and >= 1.44x the
sliding window. A correctness check against the f32 reference (forward
and the three gradients) and against cuDNN (forward) runs first.

`--block 32|128`: the same comparison at another block size, as cases
"<mix> block<z>" with no goals (the issue's are for 64), without the
sliding window (its window pairs with blocks of 64) and with the plain-jnp
reference (`xla_reference`) timed too: blocks of 128 run the jagged
kernel over the blocks (see `block_attention.op`), and before that ran
the reference on a GPU.

`--parts`, where the forward's time goes: ours with RoPE left out, and an
XLA op moving the same bytes (`q + repeat(k + v)`: reads Q, K, V, writes
a Q-sized output), each as a fraction of the copy bandwidth.
"""

import argparse
import os
import sys

from benchmarks import smoke

os.environ["XLA_FLAGS"] = smoke.xla_flags(sys.argv)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from pallas_kernels.block_attention.op import (
  block_attention_mosaic,
  sliding_window_attention,
)
from pallas_kernels.block_attention.reference import (
  block_attention_reference,
  rope_reference,
  sliding_window_reference,
)

B, LMAX, N, KH, D = 32, 2048, 8, 2, 128
BLOCK, WINDOW, THETA = 64, 64, 10_000.0
DTYPE = jnp.bfloat16
R = 4  # input sets per timed call
TAIL = 64
CUDNN = "cudnn"
INTERPRET = None  # GPU interpret mode under --smoke
SMOKE = False
PARTS = False  # --parts: where the forward's time goes
GOALS = {"fwd": 1.5, "fwdbwd": 1.5}
SLIDING_GOAL = 1.44
COPY_GOAL = 0.8
MAX_REL_ERR = 2e-2  # vs the f32 reference (and cuDNN), forward and grads


def lengths(mix, rng):
  if mix == "lognormal":
    return common.lognormal_lengths(rng, B, LMAX)
  if mix == "all2048":
    return np.full(B, LMAX, np.int32)
  raise ValueError(mix)


def blocks_of(lens):
  """Every non-empty block: (sequence, first position, valid rows)."""
  out = []
  for i, n in enumerate(lens):
    for start in range(0, int(n), BLOCK):
      out.append((i, start, min(BLOCK, int(n) - start)))
  return np.array(out, np.int32)


def to_blocks(x_t, off, blocks):
  """Packed `[t, ...]` -> `[blocks, 64, ...]`, zeros past each block."""
  seq, start, valid = blocks.T
  idx = off[seq][:, None] + start[:, None] + np.arange(BLOCK)[None, :]
  ok = np.arange(BLOCK)[None, :] < valid[:, None]
  idx = np.where(ok, idx, 0)
  return jnp.where(ok[:, :, None, None], x_t[idx], 0).astype(x_t.dtype)


def copy_bandwidth():
  """Device copy TB/s (read + write), measured here."""
  if SMOKE:
    return 1.0
  return common.copy_bandwidth()


def run_case(mix, rng, records, bw):
  lens = lengths(mix, rng)
  default = BLOCK == 64  # the block size: goals, sliding window
  case = mix if default else f"{mix} block{BLOCK}"
  off = common.offsets(lens)
  t = -(-(int(off[-1]) + TAIL) // 64) * 64
  off_j = jnp.asarray(off)
  sets = []
  for r in range(R):
    ks = jax.random.split(jax.random.key(100 * len(records) + r), 4)
    sets.append(
      (
        jax.random.normal(ks[0], (t, N, D), DTYPE),
        jax.random.normal(ks[1], (t, KH, D), DTYPE),
        jax.random.normal(ks[2], (t, KH, D), DTYPE),
        jax.random.normal(ks[3], (t, N, D), DTYPE),
      )
    )
  blocks = blocks_of(lens)
  pairs_block = float(np.sum(blocks[:, 2].astype(np.float64) ** 2))
  # Real (query, key) pairs of the sliding window: per query, the keys of
  # its sequence within WINDOW positions on either side, itself included.
  pairs_window = float(
    sum(
      np.sum(
        np.minimum(np.arange(n), WINDOW)
        + np.minimum(n - 1 - np.arange(n), WINDOW)
        + 1
      )
      for n in lens.astype(np.int64)
    )
  )
  flops = {"block": 4.0 * N * D * pairs_block}
  flops["window"] = 4.0 * N * D * pairs_window
  bytes_fwd = 2.0 * off[-1] * (2 * N * D + 2 * KH * D)

  def ours(q, k, v):
    return block_attention_mosaic(
      q,
      k,
      v,
      off_j,
      block=BLOCK,
      rope=THETA,
      max_len=LMAX,
      interpret=INTERPRET,
    )

  def sliding(q, k, v):
    return sliding_window_attention(
      q,
      k,
      v,
      off_j,
      window=WINDOW,
      rope=THETA,
      max_len=LMAX,
      implementation="mosaic",
    )

  def sliding_xla(q, k, v):
    return sliding_window_reference(
      q, k, v, off_j, window=WINDOW, rope=THETA, max_len=LMAX
    )

  def reference(q, k, v):
    return block_attention_reference(
      q, k, v, off_j, block=BLOCK, rope=THETA, max_len=LMAX
    )

  valid_j = jnp.asarray(blocks[:, 2])
  pos_blocks = jnp.asarray(blocks[:, 1])[:, None] + jnp.arange(BLOCK)

  def cudnn_blocks(q, k, v):
    nb = q.shape[0]
    flat = pos_blocks.reshape(-1)
    q = rope_reference(q.reshape(nb * BLOCK, N, D), flat, THETA)
    k = rope_reference(k.reshape(nb * BLOCK, KH, D), flat, THETA)
    return jax.nn.dot_product_attention(
      q.reshape(nb, BLOCK, N, D),
      k.reshape(nb, BLOCK, KH, D),
      v,
      implementation=CUDNN,
      query_seq_lengths=valid_j,
      key_value_seq_lengths=valid_j,
    )

  blocked = [
    tuple(to_blocks(x, off, blocks) for x in s) for s in sets
  ]  # fmt: skip

  # Correctness first: ours vs the f32 reference (forward and gradients),
  # and ours vs the cuDNN-blocks baseline (forward, real rows); see
  # `common.checked`.
  errs = common.checked(
    "block_attention",
    case,
    lambda: check(
      case, ours, reference, cudnn_blocks, sets, blocked, off, blocks
    ),
    records,
    MAX_REL_ERR,
  )

  # At the default block, our sliding window against the banded XLA one
  # in f32, and both timed; at other blocks the reference is timed.
  others = [("xla_reference", reference, sets)]
  if default:
    others = [("sliding_window_xla", sliding_xla, sets)]
    sliding_errs = common.checked(
      "block_attention",
      case,
      lambda: check_sliding(case, sliding, sliding_xla, sets[0]),
      records,
      MAX_REL_ERR,
      impl="sliding_window",
    )
    if sliding_errs is not None:
      others.insert(0, ("sliding_window", sliding, sets))
  runs = {}
  for name, fn, args in (
    *([("mosaic", ours, sets)] if errs is not None else []),
    ("cudnn_blocks", cudnn_blocks, blocked),
    *others,
  ):
    runs[name, "fwd"] = (lambda q, k, v, do, fn=fn: fn(q, k, v), args)
    runs[name, "fwdbwd"] = (common.fwd_bwd(fn), args)
  times = common.time_sets_interleaved(runs)

  for (impl, kind), sec in times.items():
    mult = 3.5 if kind == "fwdbwd" else 1.0
    op_flops = flops["window" if impl.startswith("sliding") else "block"]
    tf = op_flops * mult / sec / 1e12
    print(
      f"{case:10s} {impl:15s} {kind:7s} {sec * 1e3:8.3f} ms "
      f"{tf:7.1f} useful TFLOP/s",
      flush=True,
    )
    base = times.get(("cudnn_blocks", kind))
    records.append(
      common.record(
        "block_attention",
        case,
        impl,
        f"{kind}_ms",
        sec * 1e3,
        baseline=None if impl == "cudnn_blocks" else "cudnn_blocks",
        baseline_value=None
        if impl == "cudnn_blocks" or not base
        else base * 1e3,
        lower_is_better=True,
      )
    )
    if impl != "mosaic":
      continue
    if base:  # same op: useful TFLOP/s ratio = time ratio
      records.append(
        common.record(
          "block_attention",
          case,
          impl,
          f"{kind}_useful_tflops",
          tf,
          baseline="cudnn_blocks",
          baseline_value=op_flops * mult / base / 1e12,
          goal=GOALS[kind] if default else None,
        )
      )
    sw = times.get(("sliding_window", kind))
    if sw:  # MFU-like: each op's own useful FLOPs
      records.append(
        common.record(
          "block_attention",
          case,
          impl,
          f"{kind}_useful_tflops",
          tf,
          baseline="sliding_window",
          baseline_value=flops["window"] * mult / sw / 1e12,
          goal=SLIDING_GOAL,
        )
      )
      records.append(
        common.record(
          "block_attention",
          case,
          impl,
          f"{kind}_speedup_vs_sliding_window",
          sw / sec,
          ratio=sw / sec,
        )
      )
  fwd_times = {"mosaic": times.get(("mosaic", "fwd"))}
  if PARTS:
    no_rope = lambda q, k, v, do: block_attention_mosaic(
      q, k, v, off_j, block=BLOCK, max_len=LMAX, interpret=INTERPRET
    )
    same_bytes = lambda q, k, v, do: q + jnp.repeat(k + v, N // KH, axis=1)
    fwd_times["mosaic, RoPE left out"] = common.time_sets(no_rope, sets)
    fwd_times["xla: q + repeat(k + v), the forward's bytes"] = common.time_sets(
      same_bytes, sets
    )
  for impl, sec in fwd_times.items():
    if sec is None:
      continue
    frac = bytes_fwd / sec / 1e12 / bw
    print(f"{case:10s} {impl}: forward at {frac:.1%} of copy", flush=True)
    records.append(
      common.record(
        "block_attention",
        case,
        impl,
        "fwd_copy_bandwidth_fraction",
        frac,
        baseline="copy_tb_per_s",
        baseline_value=bw,
        goal=COPY_GOAL if impl == "mosaic" and default else None,
        ratio=frac,
      )
    )


def check_sliding(mix, sliding, sliding_xla, inputs):
  """Relative errors of our sliding window (the jagged kernel's `window`)
  vs the banded XLA one in f32, forward and gradients."""
  got = jax.jit(common.fwd_bwd(sliding))(*inputs)
  errs = common.grad_errs(got, sliding_xla, inputs)
  print(f"{mix}: sliding window rel err {errs}", flush=True)
  return errs


def check(mix, ours, reference, cudnn_blocks, sets, blocked, off, blocks):
  """Relative errors of ours vs the f32 reference and vs cuDNN."""
  q, k, v, do = sets[0]
  got = jax.jit(common.fwd_bwd(ours))(q, k, v, do)
  errs = common.grad_errs(got, reference, (q, k, v, do))
  try:  # the baseline may fail on its own; that is not our error
    o_blocks = to_blocks(got[0], off, blocks)
    c = jax.jit(cudnn_blocks)(*blocked[0][:3])
    ok = np.arange(BLOCK)[None, :] < blocks[:, 2:3]
    errs["o_vs_cudnn"] = common.rel_err(
      np.asarray(o_blocks)[ok], np.asarray(c)[ok]
    )
  except Exception as e:
    print(f"{mix}: cuDNN blocks failed: {type(e).__name__}: {str(e)[:300]}")
  print(f"{mix}: ours rel err {errs}", flush=True)
  return errs


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--mixes", default="all2048,lognormal")
  parser.add_argument(
    "--parts", action="store_true", help="RoPE left out; same-bytes copy"
  )
  parser.add_argument("--block", type=int, default=64, choices=(32, 64, 128))
  parser.add_argument("--smoke", action="store_true", help="CPU dry run")
  args = parser.parse_args()
  global B, LMAX, R, CUDNN, INTERPRET, SMOKE, PARTS, BLOCK
  PARTS, BLOCK = args.parts, args.block
  if args.smoke:  # tiny shapes, XLA instead of cuDNN, GPU interpret mode
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, LMAX, R, CUDNN = 2, 150, 1, "xla"
    common.TIMING.update(iters=1, repeats=1, rounds=1)
    INTERPRET = plgpu.InterpretGPUParams()
    SMOKE = True
  print(common.device_name(), jax.__version__, flush=True)
  bw = copy_bandwidth()
  records = []
  for mix in args.mixes.split(","):
    rng = np.random.default_rng(0)
    run_case(mix, rng, records, bw)
    path = common.write_results(
      "block_attention", records, args.out, dry_run=args.smoke
    )  # after every case: keep what was measured
  print("wrote", path)


if __name__ == "__main__":
  main()
