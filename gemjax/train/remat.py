"""Checkpoint policies per region under a memory budget (G9).

`train.activation_budget_gb` bounds the activations saved for the backward
pass on one device. Every region (`gemjax.model.remat`: `input`, each
`seq<j>`, `cross`, `heads`) starts at `nothing` (only its inputs saved);
then, greedily, the upgrade (`nothing -> dots`, `dots -> all`) that saves
the most recompute FLOPs per extra byte is taken while it fits the budget:
memory goes where it saves the most recompute per GB, GEM's rule. Regions
named in `model.remat` keep their policy (explicit overrides).

The estimates are per data shard from the config (capacities, not a
batch), times the shards each device runs (`mesh.data_shards` over the
devices, at least 1). Bytes: what each policy saves of a region, in the
compute dtype (the attention kernels' f32 row statistics aside), with a
region's inputs counted under every policy; with
`model.saved_activations="fp8"`, what `all` keeps of the dense layers'
inputs and SwiGLU's gate and up outputs at 1 + 1/128 bytes a value (e4m3
and a one-byte scale per 128). FLOPs: the forward work the
backward redoes (`dots`: attention and the elementwise work, counted as
the attention's FLOPs; `nothing`: the region's whole forward), using the
traffic's mean history length for attention.
"""

import dataclasses

import jax
import numpy as np

from gemjax.data.config import SEQ_FEATURES
from gemjax.model import remat as model_remat
from gemjax.model.layers import swiglu_hidden

ORDER = ("nothing", "dots", "all")


def estimates(cfg) -> dict:
  """`{region: {policy: (saved bytes, recompute FLOPs)}}` per device."""
  m, d_cfg = cfg.model, cfg.data
  b = np.dtype(m.dtype).itemsize
  # Bytes a value of what 8-bit saving stores (`all` regions only).
  b8 = 1 + 1 / 128 if m.saved_activations == "fp8" else b
  t, c = d_cfg.token_capacity, d_cfg.cand_capacity
  d, n, k, h = m.d_model, m.num_heads, m.num_kv_heads, m.attn_head_dim
  f, e = swiglu_hidden(d, m.ffn_mult), m.emb_dim
  mean_len = min(d_cfg.expected_tokens_per_request(), d_cfg.max_seq_len)
  shards = max(1, (cfg.mesh.data_shards or 1) // max(jax.device_count(), 1))

  def block(rows, kv_rows, attn_flops):
    """A pre-norm block on `rows` queries (and K/V on `kv_rows`)."""
    dense = 2 * rows * d * (2 * n * h) + 4 * kv_rows * d * k * h
    dense += 6 * rows * d * f
    inputs = 2 * rows * d * b
    dots = (rows * (n * h + 2 * d + 2 * f) + kv_rows * 2 * k * h) * b
    rest = rows * (2 * d + 2 * n * h + f) * b + rows * n * 4
    # The norms' outputs (Q/K/V and gate/up inputs), gate, up and the
    # down projection's input, kept in 8 bits under `all`.
    eight = rows * (2 * d + 3 * f) * (b - b8)
    return {
      "nothing": (inputs, dense + attn_flops),
      "dots": (inputs + dots, attn_flops),
      "all": (inputs + dots + rest - eight, 0.0),
    }

  out = {}
  seq_attn = 4 * n * h * t * mean_len
  for j in range(len(m.layer_order or range(m.num_layers))):
    out[f"seq{j}"] = block(t, t, seq_attn)
  cross = [block(c, t, 4 * n * h * c * mean_len) for _ in range(m.cross_layers)]
  out["cross"] = {
    p: tuple(sum(x[p][i] for x in cross) for i in range(2)) for p in ORDER
  }
  proj = 2 * t * len(SEQ_FEATURES) * e * d
  out["input"] = {
    "nothing": (0, proj),
    "dots": (t * d * b, 0.0),
    "all": (t * (len(SEQ_FEATURES) * e * b8 + 2 * d * b), 0.0),
  }
  dims = (2 * d + e, *m.head_hidden)
  head_flops = 2 * c * sum(a * z for a, z in zip(dims, dims[1:]))
  out["heads"] = {
    "nothing": (c * dims[0] * b, head_flops),
    "dots": (c * (dims[0] + sum(dims[1:])) * b, 0.0),
    # The bottom MLP's inputs (all but the towers') in 8 bits under `all`.
    "all": (c * (sum(dims[:-1]) * b8 + (dims[-1] + sum(dims[1:])) * b), 0.0),
  }
  return {
    r: {p: (v[0] * shards, v[1] * shards) for p, v in pol.items()}
    for r, pol in out.items()
  }


def choose(cfg) -> dict[str, str]:
  """`{region: policy}` for every region under the budget (see above)."""
  est = estimates(cfg)
  fixed = model_remat.parse(cfg.model.remat)
  plan = {}
  for r in est:
    base = "seq" if r.startswith("seq") and r not in fixed else r
    plan[r] = fixed.get(base, "nothing")
  budget = cfg.train.activation_budget_gb * 1e9
  used = sum(est[r][plan[r]][0] for r in est)
  free = [r for r in est if r not in fixed and not (
    r.startswith("seq") and "seq" in fixed)]  # fmt: skip
  while True:
    best = None
    for r in free:
      i = ORDER.index(plan[r])
      if i + 1 == len(ORDER):
        continue
      (b0, f0), (b1, f1) = est[r][plan[r]], est[r][ORDER[i + 1]]
      extra, saved = b1 - b0, f0 - f1
      if used + extra > budget:
        continue
      score = saved / max(extra, 1.0)
      if best is None or score > best[0]:
        best = (score, r, extra)
    if best is None:
      return plan
    _, r, extra = best
    plan[r] = ORDER[ORDER.index(plan[r]) + 1]
    used += extra


def resolve(cfg):
  """`cfg` with `model.remat` naming every region's policy when a budget
  is set (else `cfg` itself)."""
  if cfg.train.activation_budget_gb <= 0:
    return cfg
  plan = choose(cfg)
  entries = tuple(f"{r}={p}" for r, p in plan.items())
  return dataclasses.replace(
    cfg, model=dataclasses.replace(cfg.model, remat=entries)
  )


def describe(cfg) -> str:
  """One line: each region's policy and the estimated saved GB."""
  est = estimates(cfg)
  total = sum(est[r][model_remat.policy(cfg.model.remat, r)][0] for r in est)
  parts = " ".join(f"{r}={model_remat.policy(cfg.model.remat, r)}" for r in est)
  return f"remat {parts} (saved activations ~{total / 1e9:.2f} GB/device)"
