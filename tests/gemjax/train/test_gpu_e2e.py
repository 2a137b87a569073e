"""The whole training step's loss and gradients with our Mosaic GPU kernels
against the same model on the plain-`jnp` references (`dispatch.
default_implementation("xla")`), on one batch of `onetrans_v31` traffic:
the end-to-end check that the kernels, wired into the model, compute the
model. Runs on a Hopper GPU (`-m gpu`); `compare` itself also runs on CPU
(both sides references there) so its plumbing stays tested in CI."""

import dataclasses

import jax
import numpy as np
import pytest

from gemjax import config as config_lib
from gemjax.train import step as step_lib
from gemjax.train.loop import Trainer
from pallas_kernels import dispatch

# The attention kinds a config can choose, each a different set of kernels.
OPTIONS = {
  "softmax": [],
  "block": ["model.attention.seq=block", "model.attention.block_size=64"],
  "gdpa": ["model.attention.cand=gdpa", "model.pooled_queries=4"],
}
# bf16 compute on both sides; the kernels accumulate in f32 like the
# references but round P and the outputs to bf16 at other points.
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2  # |g_kernel - g_ref| / |g_ref| over all parameters
LEAF_COSINE = 0.98  # per parameter with a non-negligible gradient


def compare(config: str, overrides: list[str]) -> dict:
  """Loss and gradients of one step on the platform's kernels and on the
  references, same parameters, same batch. Returns the figures."""
  cfg = config_lib.load(config, overrides)
  cfg = dataclasses.replace(
    cfg, data=dataclasses.replace(cfg.data, workers=0, prefetch=0)
  )
  trainer = Trainer.create(cfg, devices=jax.devices()[:1])
  params = trainer.init_state()["params"]
  it = trainer.loader()
  batch = trainer.to_device(next(it))
  it.close()
  d = trainer.cfg.data

  def grads_with(implementation):
    fn = jax.value_and_grad(step_lib.loss_fn, has_aux=True)
    with dispatch.default_implementation(implementation):
      (loss, _), grads = jax.jit(
        lambda p, b: fn(
          p,
          b,
          jax.random.key(0),
          model_def=trainer.model_def,
          max_len=d.max_seq_len,
          max_cands=d.max_cands,
        )
      )(params, batch)
    return float(loss), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)

  loss_k, g_k = grads_with(None)  # the platform's choice: kernels on a GPU
  loss_r, g_r = grads_with("xla")
  flat_k, flat_r = jax.tree.leaves(g_k), jax.tree.leaves(g_r)
  assert all(np.all(np.isfinite(g)) for g in flat_k), "non-finite gradient"
  diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(flat_k, flat_r)))
  norm = np.sqrt(sum(np.sum(b**2) for b in flat_r))
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(g_r)
  ]
  cosines = {}
  for path, a, b in zip(paths, flat_k, flat_r, strict=True):
    nb = np.linalg.norm(b)
    if nb > 1e-3 * norm:
      cosines[path] = float(np.sum(a * b) / (np.linalg.norm(a) * nb + 1e-30))
  return dict(
    loss_kernel=loss_k,
    loss_reference=loss_r,
    loss_rel=abs(loss_k - loss_r) / abs(loss_r),
    grad_rel=float(diff / norm),
    worst_cosine=min(cosines.items(), key=lambda kv: kv[1]),
  )


def check(figures: dict) -> None:
  assert figures["loss_rel"] < LOSS_RTOL, figures
  assert figures["grad_rel"] < GRAD_RTOL, figures
  assert figures["worst_cosine"][1] > LEAF_COSINE, figures


@pytest.mark.gpu
@pytest.mark.parametrize("option", OPTIONS)
def test_whole_model_kernels_match_references(option):
  """`onetrans_v31` (2 of its SeqFormer layers, to compile quickly) on one
  batch of its log-normal 2K traffic: ragged lengths, empty and long
  histories, as the loader makes them."""
  figures = compare("onetrans_v31", ["model.num_layers=2", *OPTIONS[option]])
  print(option, figures)
  check(figures)


@pytest.mark.parametrize("option", OPTIONS)
def test_compare_runs_on_cpu(option):
  """The comparison's plumbing on the `smoke` config (references on both
  sides off a Hopper GPU: equal to float rounding)."""
  figures = compare(
    "smoke",
    [
      "model.d_model=32",
      "model.num_layers=1",
      "model.num_heads=4",
      "model.num_kv_heads=2",
      "data.max_seq_len=32",
      "data.len_median=12",
      "data.requests_per_shard=4",
      "data.token_capacity=160",
      "data.cand_capacity=48",
      "data.max_cands=8",
      *OPTIONS[option],
    ],
  )
  check(figures)
  if not dispatch.hopper():
    assert figures["loss_rel"] < 1e-6
    assert figures["grad_rel"] < 1e-5


def test_default_implementation_scopes_the_choice():
  """Inside the block `implementation=None` takes the named one; outside,
  the platform's choice comes back, also after an error."""
  impls = {"xla": "ref", "mosaic": "kernel"}
  platform = dispatch.pick("op", impls, None, "mosaic")
  with dispatch.default_implementation("xla"):
    assert dispatch.pick("op", impls, None, "mosaic") == "ref"
    assert dispatch.pick("op", impls, "mosaic", "mosaic") == "kernel"
  with pytest.raises(RuntimeError):
    with dispatch.default_implementation("mosaic"):
      raise RuntimeError
  assert dispatch.pick("op", impls, None, "mosaic") == platform
  with dispatch.default_implementation("mosaic"):
    # An op without that implementation takes its reference.
    assert dispatch.pick("op", {"xla": "ref"}, None, "mosaic") == "ref"
  with dispatch.default_implementation("xla", ops=("other",)):
    # Scoped to named ops: the rest keep the platform's choice.
    assert dispatch.pick("op", impls, None, "mosaic") == platform
    assert dispatch.pick("other", impls, None, "mosaic") == "ref"
  assert dispatch.pick("other", impls, None, "mosaic") == platform
  # A function jitted and traced outside is traced again inside, and again
  # after: jit's cache does not serve one choice's trace to the other.
  add = {"xla": lambda x: x + 1, "mosaic": lambda x: x + 2}
  f = jax.jit(lambda x: dispatch.pick("op", add, None, "mosaic")(x))
  outside = int(f(0))
  forced = {1: "mosaic", 2: "xla"}[outside]
  with dispatch.default_implementation(forced):
    assert int(f(0)) == 3 - outside
  assert int(f(0)) == outside
