"""What the attention-kernel tests share: one tolerance table, packed
offsets from lengths, fresh random inputs, the relative error, the race
check, and a record of the head folds an op makes.

Relative Frobenius error bound of bf16/fp16 outputs and gradients against
the f32 reference: one rounding of the inputs and outputs (2^-8 for bf16)
times a small factor; the kernels accumulate in f32, which keeps the sums
themselves exact enough.
"""

import contextlib
import io

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels import schedule

RACE_PARAMS = plgpu.InterpretGPUParams(detect_races=True)

REL_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 4e-3}


def offsets(lengths):
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def inputs(seed, t, s, n, kh, h, dtype):
  """Fresh random q `[t, n, h]`, k and v `[s, kh, h]`, do `[t, n, h]`."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (s, kh, h), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (t, n, h), jnp.float32).astype(dtype)
  return q, k, v, do


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def races(fn, *args) -> tuple[int, str]:
  """Run `fn(*args)` (kernels built with `interpret=RACE_PARAMS`); the
  races the GPU interpreter's detector reports, and its log.

  The detector's state is rebuilt for every kernel launch, so a flag read
  at the end would only cover the last kernel (the dK/dV one of a vjp);
  every detection is printed, though, so the printed log covers them all.
  """
  log = io.StringIO()
  with contextlib.redirect_stdout(log):
    jax.block_until_ready(fn(*args))
  return log.getvalue().count("RACE DETECTED"), log.getvalue()


def fwd_bwd(attn):
  """`(q, k, v, do) -> (o, dq, dk, dv)`: `attn(q, k, v)` and its vjp with
  `do`, as one jitted program. Op by op (eager), every wrapper op (work
  lists, padding, head folds) compiles on its own: about 550 XLA programs,
  half of a jagged-attention interpret case's time."""

  @jax.jit
  def run(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return (o, *vjp(do))

  return run


def assert_no_races(attn, q, k, v, do):
  """`attn(q, k, v)` and its vjp with `do` (forward and backward kernels)
  race-free under the detector."""
  n, log = races(fwd_bwd(attn), q, k, v, do)
  assert n == 0, f"{n} races:\n{log[:4000]}"


def record_folds(monkeypatch) -> list[int]:
  """The factors of every `schedule.fold_heads` call traced from now on
  (the test's op folded its query heads into rows iff the list is not
  empty)."""
  folds = []
  fold_heads = schedule.fold_heads

  def spy(x, f, kv_heads):
    folds.append(f)
    return fold_heads(x, f, kv_heads)

  monkeypatch.setattr(schedule, "fold_heads", spy)
  return folds
