"""`layers.matmul`: the compute-dtype GEMM every `Dense` runs, both ways."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemjax.model import layers


def _inputs(seed, dtype):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k1, (2, 37, 48), jnp.float32).astype(dtype)
  w = jax.random.normal(k2, (48, 24), jnp.float32) * 0.1  # f32 parameter
  ct = jax.random.normal(k3, (2, 37, 24), jnp.float32)
  return x, w, ct


def _loss(mm, x, w, ct):
  return jnp.sum(mm(x, w).astype(jnp.float32) * ct)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_values_and_gradients_match_f32(dtype):
  x, w, ct = _inputs(0, dtype)
  ours = lambda x, w: layers.matmul(x, w, dtype)
  ref = lambda x, w: jnp.einsum("...i,io->...o", x.astype(jnp.float32), w)
  (dx, dw) = jax.grad(_loss, (1, 2))(ours, x, w, ct)
  (rdx, rdw) = jax.grad(_loss, (1, 2))(ref, x, w, ct)
  assert dx.dtype == dtype and dw.dtype == jnp.float32
  # bf16: operands and results rounded to 8 bits of mantissa.
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
  for got, want in ((ours(x, w), ref(x, w)), (dx, rdx), (dw, rdw)):
    got = np.asarray(got, np.float32)
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_bf16_gemms_take_bf16_operands_in_the_backward():
  """The f32 cotangent of an f32-accumulating dot must not turn the
  backward GEMMs into f32 x f32 (TF32 on the GPU)."""
  x, w, ct = _inputs(1, jnp.bfloat16)
  mm = lambda x, w: layers.matmul(x, w, jnp.bfloat16)
  text = (
    jax.jit(jax.value_and_grad(_loss, (1, 2)), static_argnums=0)
    .lower(mm, x, w, ct)
    .as_text()
  )
  dots = [s for s in text.splitlines() if "dot_general" in s]
  assert len(dots) == 3  # forward, dX, dW
  for line in dots:
    operands = re.search(r":\s*\((.*)\)\s*->", line).group(1)
    assert "f32" not in operands, line
