"""Per-region activation checkpointing (G9): which activations a region
keeps for the backward pass, and which it recomputes.

GEM gives every compiled region its own checkpoint budget, so memory goes
where it saves the most recompute per GB. The model's regions are its
natural blocks:
- `input`: the embedding concatenation and the token projection;
- `seq<j>`: the `j`-th SeqFormer block application (`seq` names them all);
- `cross`: the candidate cross blocks, together;
- `heads`: the bottom MLP and the task towers.

Each takes one policy (`ModelConfig.remat`, entries `region=policy`; a
`seq<j>` entry overrides `seq`):
- `all`: no checkpoint, every intermediate saved (JAX's default);
- `dots`: `jax.checkpoint` saving only matmul outputs without batch
  dimensions (the projections and the FFN); norms, activations and the
  attention kernels are recomputed;
- `nothing`: `jax.checkpoint` saving only the region's inputs; the whole
  region's forward runs again in the backward pass.
The values are identical either way (tested); only memory and time move.
`gemjax.train.remat` chooses the policies under a memory budget.

8-bit saved activations (`ModelConfig.saved_activations="fp8"`) apply to
what a region keeps across the step, so to `all` regions only: a region
under `dots` or `nothing` is traced inside `layers.recomputed_region`,
where the layers keep their inputs as they are (recomputed in the
backward, or, under `dots`, read from saved matmul outputs in the compute
dtype), the numbers of a run without 8-bit saving.
"""

import functools

import jax

from gemjax.model import layers

POLICIES = ("all", "dots", "nothing")
_JAX_POLICY = {
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "nothing": jax.checkpoint_policies.nothing_saveable,
}


def parse(entries) -> dict[str, str]:
  """`("seq=nothing", "heads=dots")` -> `{"seq": "nothing", ...}`."""
  out = {}
  for item in entries:
    region, sep, policy = item.partition("=")
    if not sep or policy not in POLICIES or not _region_ok(region):
      raise ValueError(
        f"remat entry {item!r}: region=policy, region one of input, "
        f"seq, seq<j>, cross, heads; policy one of {POLICIES}"
      )
    out[region] = policy
  return out


def _region_ok(region: str) -> bool:
  if region in ("input", "seq", "cross", "heads"):
    return True
  return region.startswith("seq") and region[3:].isdigit()


def policy(entries, region: str) -> str:
  """The policy of `region` ("seq3" falls back to "seq"); default all."""
  table = parse(entries)
  if region in table:
    return table[region]
  if region.startswith("seq") and "seq" in table:
    return table["seq"]
  return "all"


def checkpoint(fn, name: str):
  """`fn` under the policy `name` (`all`: `fn` itself)."""
  if name == "all":
    return fn

  @functools.wraps(fn)
  def recomputed(*args, **kwargs):
    with layers.recomputed_region():
      return fn(*args, **kwargs)

  return jax.checkpoint(recomputed, policy=_JAX_POLICY[name])
