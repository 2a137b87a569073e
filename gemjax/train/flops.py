"""Model FLOPs of a training step, the device's peak, and local MFU (G11).

GEM reports "E2E MFU = local MFU x scaling ratio": local MFU is the model's
useful FLOPs per second on one device over the device's datasheet peak.
Useful FLOPs are counted from the config and the batch actually run, on
real tokens and candidates only: a padded token, an empty buffer tail or a
recomputed activation (remat: hardware FLOPs, not model FLOPs) counts
nothing. So removing padding (O10) raises MFU only by running faster, never
by counting more.

What is counted (a multiply-add is 2 FLOPs; legend: `T` real history
tokens, `C` real candidates, `R` real requests, `d` d_model, `n`/`k` query
/ KV heads, `h` head dim, `f` SwiGLU width, `e` emb_dim):
- input projections: tokens `2 T (6 e) d` (`input_tokens`), candidates
  `2 C (3 e) d` and dense features `2 R num_dense d` (`input_other`);
- each SeqFormer block (as often as `layer_order` applies it): Q/K/V/O
  `2 T d (2 n h + 2 k h)`, SwiGLU `6 T d f`, attention `4 n h` per
  (query, key) pair it computes: `L^2` per sequence of length `L` for
  softmax, `L (L + 1) / 2` causal, the pairs inside each `block_size`
  block for block attention, the pairs with `|p - j| <= window` for
  sliding windows (and `j <= p` when causal);
- each cross block: Q/O `4 C d n h` on candidates, K/V `4 T d k h` on the
  history (computed once per request, O12), SwiGLU `6 C d f`, attention
  `4 n h` per (candidate, history token) pair of its request (softmax or
  GDPA alike);
- pooled attention (`pooled_queries = p`): K/V `4 T d k h`, `4 n h p L`
  per sequence, output projection `2 R (p n h) d`;
- DHEN layers: `10 C D^2` each (`D = 2 d + e`: MLP expert `D -> 2D -> D`,
  cross expert `D -> D`);
- heads: the bottom MLP and one `hidden[-1] -> 1` tower per task, on `C`.
Norms, RoPE, activations, softmax, embedding gathers and the optimizer are
not counted (elementwise or memory work; XLA's `cost_analysis` counts
some of them, a few percent at the model's widths:
`tests/gemjax/train/test_flops.py` compares). Training is 3x the forward
(the backward computes two products per forward product). Recompute
under activation checkpointing is hardware work, not model work:
`StepFlops.recompute` counts it apart.

Peak: the dense bf16 (and FP8) datasheet figure of the device kind
(`PEAK_TFLOPS`); MFU is always against the dense bf16 peak, whatever the
compute dtype, so that bf16 and FP8 runs compare on one scale (the FP8
peak is listed for reference). Kinds not in the table (CPU, other GPUs)
get no peak and no MFU: a made-up peak would make a made-up MFU.
"""

import dataclasses
import functools

import numpy as np

from gemjax.data.config import CAND_FEATURES, SEQ_FEATURES
from gemjax.model import remat
from gemjax.model.layers import swiglu_hidden

# Dense (no sparsity) datasheet TFLOP/s of the SXM parts: bf16, fp8.
PEAK_TFLOPS = {
  "H100": {"bf16": 989.0, "fp8": 1979.0},
  "H200": {"bf16": 989.0, "fp8": 1979.0},
}


def device_peak(device_kind: str, precision: str = "bf16") -> float | None:
  """Dense peak FLOP/s of a device kind (`jax.Device.device_kind`, e.g.
  "NVIDIA H200"), or None for kinds not in `PEAK_TFLOPS`. H100 PCIe and
  NVL parts have lower clocks and are not the SXM part: None."""
  kind = device_kind.upper()
  if any(s in kind for s in ("PCIE", "NVL")):
    return None
  for name, peaks in PEAK_TFLOPS.items():
    if name in kind:
      return peaks[precision] * 1e12
  return None


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """Forward model FLOPs of one step by part; `train` = 3x the total."""

  parts: dict

  @property
  def forward(self) -> float:
    return float(sum(self.parts.values()))

  @property
  def train(self) -> float:
    return 3.0 * self.forward

  def recompute(self, model_cfg) -> float:
    """Forward FLOPs the backward pass redoes under `model_cfg.remat`
    (`gemjax.model.remat`): a `nothing` region its whole forward, a
    `dots` region its attention. Hardware FLOPs = `train` + this."""
    p = self.parts
    policy = functools.partial(remat.policy, model_cfg.remat)
    depth = len(model_cfg.layer_order or range(model_cfg.num_layers))
    regions = [
      (f"seq{j}", p["seq_dense"] / depth, p["seq_attention"] / depth)
      for j in range(depth)
    ]
    regions += [
      ("cross", p["cross_dense"], p["cross_attention"]),
      ("input", p["input_tokens"], 0.0),
      ("heads", p["heads"], 0.0),
    ]
    total = 0.0
    for region, dense, attention in regions:
      name = policy(region)
      if name == "nothing":
        total += dense + attention
      elif name == "dots":
        total += attention
    return total


def attention_pairs(
  lengths,
  *,
  causal: bool = False,
  window: int | None = None,
  block: int | None = None,
) -> int:
  """(query, key) pairs self-attention computes over sequences of these
  lengths: all pairs, or those inside `block`-position blocks, or those
  within `window` positions; `causal` keeps `j <= p`."""
  lengths = np.asarray(lengths, np.int64)
  if block is not None:
    full, rest = lengths // block, lengths % block
    sizes = [(full, block), (1, rest)]
    return int(sum(np.sum(m * _pairs(z, causal)) for m, z in sizes))
  if window is None:
    return int(np.sum(_pairs(lengths, causal)))
  w = np.minimum(window, np.maximum(lengths - 1, 0))
  # Pairs with 0 <= p - j <= w in a sequence of length L: sum over the
  # distance delta = 0..w of (L - delta).
  one_side = (w + 1) * lengths - w * (w + 1) // 2
  return int(np.sum(one_side if causal else 2 * one_side - lengths))


def _pairs(length, causal: bool):
  length = np.asarray(length, np.int64)
  return length * (length + 1) // 2 if causal else length * length


def step_flops(cfg, batch) -> StepFlops:
  """Model FLOPs of `cfg` (a `Config`) on `batch`: a `JaggedBatch`, one
  or stacked (`[S, b+1]` offsets), with concrete (host) offsets."""
  m = cfg.model
  off = np.asarray(batch.offsets).reshape(-1, batch.offsets.shape[-1])
  cand_off = np.asarray(batch.cand_offsets).reshape(off.shape)
  lens = np.diff(off, axis=-1).reshape(-1).astype(np.int64)
  cands = np.diff(cand_off, axis=-1).reshape(-1).astype(np.int64)
  real = (lens > 0) | (cands > 0)
  t, c, r = int(lens.sum()), int(cands.sum()), int(real.sum())
  d, n, k, h = m.d_model, m.num_heads, m.num_kv_heads, m.attn_head_dim
  e = m.emb_dim
  f = swiglu_hidden(d, m.ffn_mult)
  qkvo = 2 * d * (2 * n * h + 2 * k * h)  # per token, Q/K/V/O
  ffn = 6 * d * f  # per token, gate + up + down
  depth = len(m.layer_order or range(m.num_layers))
  a = m.attention
  if a.seq == "block":
    pairs = attention_pairs(lens, causal=a.causal, block=a.block_size)
  elif a.seq == "sliding":
    pairs = attention_pairs(lens, causal=a.causal, window=a.sliding_window)
  else:
    pairs = attention_pairs(lens, causal=a.causal)
  parts = {
    "input_tokens": 2 * t * len(SEQ_FEATURES) * e * d,
    "input_other": 2 * c * len(CAND_FEATURES) * e * d
    + 2 * r * max(cfg.data.num_dense, 1) * d,
    "seq_dense": depth * t * (qkvo + ffn),
    "seq_attention": depth * 4 * n * h * pairs,
    "cross_dense": m.cross_layers
    * (c * (4 * d * n * h + ffn) + t * 4 * d * k * h),
    "cross_attention": m.cross_layers * 4 * n * h * int(np.sum(lens * cands)),
  }
  if m.pooled_queries:
    p = m.pooled_queries
    parts["pooled"] = (
      t * 4 * d * k * h + 4 * n * h * p * t + 2 * r * p * n * h * d
    )
  dims = (2 * d + e, *m.head_hidden)
  if m.dhen_layers:
    parts["dhen"] = m.dhen_layers * 10 * c * dims[0] ** 2
  parts["heads"] = (
    2
    * c
    * (
      sum(a * b for a, b in zip(dims[:-1], dims[1:], strict=True))
      + dims[-1] * len(m.tasks)
    )
  )
  return StepFlops({k: float(v) for k, v in parts.items()})


def mfu(flops_per_s: float, device_kind: str) -> float | None:
  """Local MFU against the dense bf16 peak; None where no peak is known."""
  peak = device_peak(device_kind)
  return None if peak is None else flops_per_s / peak
