"""The whole `onetrans_v31` training step on one GPU against the padded
model a JAX user would write (G11, O10).

  cd <repo> && PYTHONPATH=. python3 benchmarks/train_step.py --out "$OUT"
  PYTHONPATH=. python3 benchmarks/train_step.py --smoke   # CPU, seconds

Variants (`--variants`, comma-separated), each a training step (forward,
backward, optimizer) of the same parameters on the same requests:
- `padded`: the same model in plain JAX on padded `[b, max_seq_len]`
  histories and `[b, max_cands]` candidates: its own modules' weights
  (`padded_forward` reuses the projections, SwiGLU, embeddings and heads),
  `jax.nn.dot_product_attention(implementation="cudnn")` with per-request
  lengths masking the padding, the XLA RMSNorm (`implementation="xla"`),
  the same GQA, QK-norm, RoPE and optimizer. This is the seed's "before".
- `ours`: the library's step (`Trainer.train_step`): jagged batches, our
  kernels, the config as shipped.
- `fp8`: `ours` with `model.fp8.format=deepseek` (G4); `fp8dw`: and the
  weight gradients in FP8 (`model.fp8.weight_grads`).
- `act8`: `ours` with `model.saved_activations=fp8`: the activations kept
  for the backward in 8 bits (G9).
- `batchNx`: `ours` on N times the requests per step (N consecutive
  batches of the same traffic packed into one, capacities N times larger).
- `remat-<policy>`: `ours` with every region checkpointed by `policy`
  (`dots`, `nothing`: G9); `budget<GB>`: policies chosen under a budget.
- `xla-<op>`: `ours` with one kernel family on its XLA reference (e.g.
  `xla-rms_norm`: where XLA fuses the norm into its neighbours).
- knobs combine with `+`, e.g. `batch8x+remat-nothing`.

For each: step ms (median over rounds, timed in alternation:
`common.time_interleaved`), requests/s, real tokens/s, model TFLOP/s
(`gemjax.train.flops`, real tokens only, 3x forward; hardware TFLOP/s
with the recompute of remat variants), local MFU against
the dense bf16 datasheet peak (none on CPU), the compiled program's device
memory (`memory_analysis`: arguments + temporaries + outputs not aliased)
and, on a GPU, a trace of the step split by category
(`categorize`: attention kernels, GEMMs, norms, embedding gathers /
scatters, optimizer, data transfer, other), from each kernel's name and
the HLO op's source location. The measured cuBLAS bf16 peak (8192^3) is
printed beside the datasheet's.

Goals: ours >= 2.0x the padded variant's requests/s; local MFU >= 0.40.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import gzip
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks import smoke as smoke_lib

os.environ["XLA_FLAGS"] = smoke_lib.xla_flags(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pallas_kernels  # noqa: E402
from benchmarks import common  # noqa: E402
from gemjax import config as config_lib  # noqa: E402
from gemjax.data import jagged  # noqa: E402
from gemjax.data import loader as data_loader  # noqa: E402
from gemjax.data.config import CAND_FEATURES, SEQ_FEATURES  # noqa: E402
from gemjax.train import flops as flops_lib  # noqa: E402
from gemjax.train import remat as remat_lib  # noqa: E402
from gemjax.train.loop import Trainer  # noqa: E402
from gemjax.train.optim import make_optimizer  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels.block_attention.reference import rope_reference  # noqa: E402

NAME = "train_step"
GOAL_SPEEDUP = 2.0
GOAL_MFU = 0.40  # onetrans_v31's `ours`
GOAL_FP8 = 1.25  # `fp8` over `ours` on a config wide enough (gem_base)
BATCHES = 3  # input sets rotated in timing


# ---------------------------------------------------------------------------
# Data: jagged batches, the same requests packed larger, and padded
# ---------------------------------------------------------------------------


def concat(batches):
  """Jagged batches -> one batch holding all their requests, capacities
  summed (each part's unused tail dropped, zeros at the end)."""
  tok_cap = sum(b.token_capacity for b in batches)
  cand_cap = sum(b.cand_capacity for b in batches)

  def packed(parts, ends, cap):
    x = np.concatenate([p[:e] for p, e in zip(parts, ends, strict=True)])
    pad = np.zeros((cap - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])

  def offsets(parts):
    out, shift = [np.zeros(1, np.int32)], 0
    for o in parts:
      out.append(o[1:] + shift)
      shift += o[-1]
    return np.concatenate(out).astype(np.int32)

  t_end = [b.offsets[-1] for b in batches]
  c_end = [b.cand_offsets[-1] for b in batches]
  return jagged.JaggedBatch(
    offsets=offsets([b.offsets for b in batches]),
    seq={
      f: packed([b.seq[f] for b in batches], t_end, tok_cap)
      for f in batches[0].seq
    },
    cand_offsets=offsets([b.cand_offsets for b in batches]),
    cand={
      f: packed([b.cand[f] for b in batches], c_end, cand_cap)
      for f in batches[0].cand
    },
    labels=packed([b.labels for b in batches], c_end, cand_cap),
    user_id=np.concatenate([b.user_id for b in batches]),
    dense=np.concatenate([b.dense for b in batches]),
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PaddedBatch:
  """One data shard padded: histories `[b, l]`, candidates `[b, c]`."""

  seq: dict
  seq_len: jax.Array  # int32[b]
  cand: dict
  cand_len: jax.Array  # int32[b]
  labels: jax.Array  # f32[b, c, tasks]
  dense: jax.Array  # f32[b, f]


def pad_batch(b, max_len: int, max_cands: int) -> PaddedBatch:
  """A (single-shard) `JaggedBatch` -> `PaddedBatch` (host, numpy)."""
  pad = lambda x, off, n: jagged.to_padded(x, off, n)[0]
  return PaddedBatch(
    seq={f: pad(v, b.offsets, max_len) for f, v in b.seq.items()},
    seq_len=np.diff(b.offsets).astype(np.int32),
    cand={f: pad(v, b.cand_offsets, max_cands) for f, v in b.cand.items()},
    cand_len=np.diff(b.cand_offsets).astype(np.int32),
    labels=pad(b.labels, b.cand_offsets, max_cands),
    dense=b.dense,
  )


# ---------------------------------------------------------------------------
# The padded model: the library's modules on padded tensors
# ---------------------------------------------------------------------------


def _norm(mod, x, residual=None):
  """The module's RMSNorm computed by XLA (the reference op)."""
  return pallas_kernels.rms_norm(
    x, mod.gamma[...].astype(x.dtype), residual, eps=mod.eps,
    implementation="xla",
  )  # fmt: skip


def _attend(att, x_q, x_kv, q_len, kv_len, impl, rope_theta=None):
  """GQA attention with QK-norm (and RoPE) on `[b, l, d]` inputs, the
  padding masked by per-request lengths."""
  b, lq, _ = x_q.shape
  s = x_kv.shape[1]
  q = att.q(x_q).reshape(b * lq, att.n, att.h)
  k = att.k_proj(x_kv).reshape(b * s, att.k, att.h)
  v = att.v_proj(x_kv).reshape(b, s, att.k, att.h)
  if att.q_norm is not None:
    q, k = _norm(att.q_norm, q), _norm(att.k_norm, k)
  if rope_theta is not None:  # in-sequence positions: 0..l-1 in every row
    q = rope_reference(q, jnp.tile(jnp.arange(lq), b), rope_theta)
    k = rope_reference(k, jnp.tile(jnp.arange(s), b), rope_theta)
  o = jax.nn.dot_product_attention(
    q.reshape(b, lq, att.n, att.h),
    k.reshape(b, s, att.k, att.h),
    v,
    implementation=impl,
    query_seq_lengths=q_len,
    key_value_seq_lengths=kv_len,
  )
  return att.o(o.reshape(b, lq, att.n * att.h))


def padded_forward(model, pb: PaddedBatch, impl):
  """`RankingModel.features` + `head` on padded tensors -> `[b, c, tasks]`.
  Supports the `onetrans_v31` family: softmax attention in both stages,
  no pooled queries, no DHEN, no FP8."""
  cfg = model.cfg
  if (
    cfg.attention.seq != "softmax"
    or cfg.attention.cand != "softmax"
    or model.pooling is not None
    or model.dhen is not None
    or cfg.fp8.format != "off"
    or cfg.attention.causal
  ):
    raise ValueError("padded variant: softmax attention, bf16 model only")
  dtype = jnp.dtype(cfg.dtype)
  lmax = pb.seq["item_id"].shape[1]
  valid_bl = jnp.arange(lmax) < pb.seq_len[:, None]
  x = model.token_proj(model.embeddings.concat(pb.seq, SEQ_FEATURES))
  x = jnp.where(valid_bl[..., None], x, 0).astype(dtype)  # [b, l, d]
  sf, theta = model.seqformer, model.seqformer.rope_theta
  # Attention lengths of at least 1: a request without history (or
  # candidates) attends to its zero padding row, whose K and V are zero
  # (no bias; QK-norm and RoPE of zero are zero), so its output is the
  # jagged model's zero; and cuDNN never sees an empty sequence.
  seq_len = jnp.maximum(pb.seq_len, 1)
  cand_len = jnp.maximum(pb.cand_len, 1)
  h, delta = x, None
  for i in sf.order:
    blk = sf.blocks[i]
    y, h = (
      (_norm(blk.attn_norm, h), h)
      if delta is None
      else _norm(blk.attn_norm, delta, h)
    )
    delta = _attend(blk.attn, y, y, seq_len, seq_len, impl, theta)
    y, h = _norm(blk.ffn_norm, delta, h)
    delta = blk.ffn(y)
  seq = _norm(sf.final_norm, delta, h)[0]
  user = model.dense_proj(pb.dense)  # [b, d]
  cand = model.embeddings.concat(pb.cand, CAND_FEATURES)
  c = (model.cand_proj(cand) + user[:, None]).astype(dtype)  # [b, c, d]
  for blk in model.cross:
    c = c + _attend(
      blk.attn, _norm(blk.attn_norm, c), seq, cand_len, seq_len, impl
    )
    c = c + blk.ffn(_norm(blk.ffn_norm, c))
  c = _norm(model.cand_norm, c)
  item = model.embeddings.lookup("item_id", pb.cand["item_id"])
  user_bc = jnp.broadcast_to(user[:, None], c.shape[:2] + user.shape[-1:])
  feats = jnp.concatenate([c, user_bc.astype(dtype), item.astype(dtype)], -1)
  return model.head(feats)


def padded_loss(params, pb, *, model_def, impl):
  """The library's loss (`step.loss_fn`: mean over real candidates of the
  per-task binary cross-entropy, summed over tasks) on padded logits."""
  logits = padded_forward(model_def.bind(params), pb, impl)
  c = logits.shape[1]
  mask = (jnp.arange(c) < pb.cand_len[:, None])[..., None]
  per = optax.sigmoid_binary_cross_entropy(logits, pb.labels)
  count = jnp.maximum(jnp.sum(mask), 1)
  task_loss = jnp.sum(jnp.where(mask, per, 0), axis=(0, 1)) / count
  return jnp.sum(task_loss), task_loss


def padded_train_step(state, pb, *, model_def, tx, impl):
  grad_fn = jax.value_and_grad(padded_loss, has_aux=True)
  (loss, task_loss), grads = grad_fn(
    state["params"], pb, model_def=model_def, impl=impl
  )
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  new = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
  return new, {"loss": loss, "task_loss": task_loss}


# ---------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
  """One timed training step with its state and device batches."""

  name: str
  cfg: object
  host: list  # host batches (jagged, stacked over 1 shard)
  lowered: object = None
  compiled: object = None
  state: dict = None
  batches: list = None
  compile_s: float = 0.0

  def __call__(self, i):
    self.state, m = self.compiled(self.state, self.batches[i])
    return m["loss"]


def variant_config(base, name):
  """(config, requests-per-step factor) of a variant name: `padded`,
  `ours`, or knobs joined by `+`: `fp8`, `fp8dw`, `act8`, `batch<N>x`,
  `remat-<policy>` (every region, `gemjax.model.remat`), `budget<GB>` (a
  `train.activation_budget_gb`), `xla-<op>` (that kernel family on its XLA
  reference, e.g. `xla-rms_norm`: `xla_ops`)."""
  if name in ("ours", "padded"):
    return base, 1
  cfg, factor, regions = base, 1, ("input", "seq", "cross", "heads")
  for knob in name.split("+"):
    batch = re.fullmatch(r"batch(\d+)x", knob)
    budget = re.fullmatch(r"budget([\d.]+)", knob)
    if knob == "fp8":
      cfg = config_lib.apply_overrides(cfg, ["model.fp8.format=deepseek"])
    elif knob == "fp8dw":  # the weight gradients in FP8 too
      cfg = config_lib.apply_overrides(
        cfg, ["model.fp8.format=deepseek", "model.fp8.weight_grads=true"]
      )
    elif knob == "act8":
      cfg = config_lib.apply_overrides(cfg, ["model.saved_activations=fp8"])
    elif knob.startswith("remat-"):
      policy = knob.removeprefix("remat-")
      entries = ",".join(f"{r}={policy}" for r in regions)
      cfg = config_lib.apply_overrides(cfg, [f"model.remat={entries}"])
    elif knob.startswith("xla-"):
      pass  # not a config: `xla_ops` scopes the lowering
    elif budget:
      cfg = config_lib.apply_overrides(
        cfg, [f"train.activation_budget_gb={budget.group(1)}"]
      )
    elif batch:
      factor = int(batch.group(1))
      d = cfg.data
      cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(
          d,
          requests_per_shard=factor * d.requests_per_shard,
          token_capacity=factor * d.token_capacity,
          cand_capacity=factor * d.cand_capacity,
        ),
      )
    else:
      raise ValueError(
        f"unknown variant knob {knob!r} in {name!r}: fp8, fp8dw, act8, "
        "batch<N>x, remat-<policy>, budget<GB>, xla-<op> (or the variants "
        "padded, ours)"
      )
  return cfg, factor


def xla_ops(name) -> tuple[str, ...]:
  """The kernel families a variant's `xla-<op>` knobs put on XLA."""
  return tuple(
    k.removeprefix("xla-") for k in name.split("+") if k.startswith("xla-")
  )


def build_variants(base, names, shards, smoke):
  """Variants sharing the same requests: `shards` are single-shard host
  batches of the base config, `BATCHES * max factor` of them."""
  dev = jax.devices()[:1]
  impl = "xla" if smoke else "cudnn"
  out, state0 = [], None
  for name in names:
    cfg, n = variant_config(base, name)
    host = [
      jagged.stack([concat(shards[i * n : (i + 1) * n])])
      for i in range(BATCHES)
    ]
    tr = Trainer.create(cfg, tempfile.mkdtemp(), devices=dev)
    state = tr.init_state() if state0 is None else None
    state0 = state0 or jax.device_get(state)
    state = jax.device_put(state0, tr.state_shardings)
    v = Variant(name, cfg, host)
    if name == "padded":
      d = cfg.data
      step = jax.jit(
        functools.partial(
          padded_train_step,
          model_def=tr.model_def,
          tx=make_optimizer(cfg.train),
          impl=impl,
        ),
        donate_argnums=0,
      )
      v.batches = [
        jax.device_put(pad_batch(_shard0(b), d.max_seq_len, d.max_cands))
        for b in host
      ]
    else:
      step = tr.train_step
      v.batches = [tr.to_device(b) for b in host]
    v.state = state
    ops = xla_ops(name)
    scope = dispatch.default_implementation("xla", ops) if ops else None
    try:
      with scope or contextlib.nullcontext():
        v.lowered = step.lower(state, v.batches[0])
    except Exception as e:  # noqa: BLE001 - report, time the others
      print(f"  {name}: FAILED to trace: {type(e).__name__}: {e}"[:2000])
      continue
    out.append(v)
  return out


def _shard0(b):
  return jax.tree.map(lambda x: x[0], b)


def compile_all(variants):
  """Compile every variant's step at once (XLA compiles off the GIL)."""

  def one(v):
    t0 = time.perf_counter()
    try:
      v.compiled = v.lowered.compile()
    except Exception as e:  # noqa: BLE001 - report, time the others
      print(f"  {v.name}: FAILED to compile: {type(e).__name__}: {e}"[:2000])
      return None
    v.compile_s = time.perf_counter() - t0
    print(f"  {v.name}: compiled in {v.compile_s:.1f} s", flush=True)
    return v

  with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
    return [v for v in pool.map(one, variants) if v is not None]


def compiled_bytes(compiled) -> float | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  return float(
    m.argument_size_in_bytes
    + m.temp_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
  )


# ---------------------------------------------------------------------------
# Where the time goes
# ---------------------------------------------------------------------------

CATEGORIES = (
  "attention",
  "gemm",
  "norm",
  "embedding",
  "optimizer",
  "transfer",
  "other",
)
# Kernel-name rules first (library kernels have telling names), then the
# HLO op's metadata (its JAX op name and source file).
_KERNEL_RULES = (
  ("attention", ("sdpa", "fmha", "flash", "cudnn", "attention", "gdpa")),
  # FP8 GEMMs count their operands' quantization (`fp8_quantize*`).
  (
    "gemm",
    ("gemm", "nvjet", "xmma", "cutlass", "matmul", "cublas", "fp8_quantize"),
  ),
  ("norm", ("rms_norm", "rmsnorm")),
  ("transfer", ("memcpy", "memset")),
)
_META_RULES = (
  ("optimizer", ("optax", "gemjax/train/optim")),
  (
    "attention",
    (
      "jagged_attention",
      "gdpa",
      "block_attention",
      "dot_product_attention",
      "nn/functions.py",
    ),
  ),
  ("norm", ("rms_norm",)),
  ("gemm", ("dot_general", "pallas_kernels/fp8")),
  ("embedding", ("embeddings.py", "gather", "scatter")),
)


def hlo_metadata(hlo_text: str) -> dict:
  """HLO instruction name -> its metadata as text: the JAX op name and the
  files and functions of its Python stack (the module's `StackFrames`
  tables, which `stack_frame_id` indexes; a frame's `parent_frame_id` is
  one more than its parent's id, 0 for none)."""
  tables, section = {}, None
  row = re.compile(r"^(\d+) (.*)$")
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = tables.setdefault(line, {})
      continue
    m = row.match(line) if section is not None else None
    if m:
      section[int(m.group(1))] = m.group(2)
    elif line.strip():
      section = None
  field = lambda text, key: int(re.search(rf"{key}=(\d+)", text).group(1))
  files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
  locs, frames = tables.get("FileLocations", {}), tables.get("StackFrames", {})

  def stack(frame: int) -> str:
    parts, seen = [], set()
    while frame in frames and frame not in seen:
      seen.add(frame)
      loc = locs.get(field(frames[frame], "file_location_id"), "")
      if loc:
        parts.append(files.get(field(loc, "file_name_id"), ""))
        parts.append(funcs.get(field(loc, "function_name_id"), ""))
      frame = field(frames[frame], "parent_frame_id") - 1
    return " ".join(parts)

  out = {}
  pat = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*metadata=\{([^}]*)\}")
  for line in hlo_text.splitlines():
    m = pat.match(line)
    if m:
      meta = m.group(2)
      f = re.search(r"stack_frame_id=(\d+)", meta)
      out[m.group(1)] = meta + (" " + stack(int(f.group(1))) if f else "")
  return out


def categorize(kernel: str, meta: str) -> str:
  k, mt = kernel.lower(), meta.lower()
  for cat, keys in _KERNEL_RULES:
    if any(s in k for s in keys):
      return cat
  for cat, keys in _META_RULES:
    if any(s in mt for s in keys):
      return cat
  if "gather" in k or "scatter" in k:
    return "embedding"
  return "other"


def trace_breakdown(
  v: Variant, steps: int, keep=None, device="/device:GPU"
) -> dict:
  """Device ms per step by category from a profiler trace of `steps`
  steps, two ways: "kernels" (the GPU streams' kernels: kernel name, and
  the HLO op's metadata where the event names its `hlo_op`) and "ops"
  (the trace's XLA Ops line: HLO op names, looked up in the compiled
  program's metadata). `keep`: a path to copy the perfetto trace to."""
  with tempfile.TemporaryDirectory() as log_dir:
    common.trace_calls(v, [(i,) for i in range(BATCHES)], steps, log_dir)
    events = common._trace_events(log_dir) or []
    found = sorted(pathlib.Path(log_dir).rglob("perfetto_trace.json.gz"))
    if keep and found and found[-1].stat().st_size < 15e6:
      shutil.copy(found[-1], keep)
  names = common._process_names(events)
  threads = {
    (e["pid"], e["tid"]): e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  meta = hlo_metadata(v.compiled.as_text())
  out = {}
  for how in ("kernels", "ops"):
    by_cat = {c: 0.0 for c in CATEGORIES}
    top = {c: {} for c in CATEGORIES}
    spans, attributed = [], 0
    for e in events:
      pid = e.get("pid")
      if e.get("ph") != "X" or device not in names.get(pid, ""):
        continue
      thread = threads.get((pid, e.get("tid")), "")
      is_ops = "XLA Ops" in thread
      if (how == "ops") != is_ops or "XLA Modules" in thread:
        continue
      args = e.get("args") or {}
      # A kernel event names its HLO op in `hlo_op`; inside a CUDA graph
      # that is the command buffer, and the kernel's own name (a fusion's
      # instruction name) is the one to look up.
      hlo = e["name"] if is_ops else str(args.get("hlo_op", ""))
      if not is_ops and hlo not in meta:
        hlo = e["name"]
      attributed += hlo in meta
      text = meta.get(hlo, "") + " " + " ".join(map(str, args.values()))
      cat = categorize("" if is_ops else e["name"], text)
      ms = e.get("dur", 0.0) / 1e3 / steps
      by_cat[cat] += ms
      key = e["name"][:60]
      top[cat][key] = top[cat].get(key, 0.0) + ms
      spans.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    out[how] = {
      "ms": by_cat,
      "busy_ms": common.union_length(spans) / 1e3 / steps,
      "events": len(spans) / steps,
      "with_hlo_metadata": attributed / max(len(spans), 1),
      "top": {
        c: sorted(t.items(), key=lambda kv: -kv[1])[:5] for c, t in top.items()
      },
    }
  return out


def cublas_peak() -> float:
  """Measured bf16 matmul TFLOP/s at 8192^3 (the GPU's practical peak)."""
  n = 8192
  xs = [
    (
      jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16),
      jax.random.normal(jax.random.key(i + 9), (n, n), jnp.bfloat16),
    )
    for i in range(2)
  ]
  sec = common.device_time(jax.jit(jnp.matmul), xs, calls=10, repeats=5)
  return 2 * n**3 / sec / 1e12


# ---------------------------------------------------------------------------


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
    "--config", default=None, help="default onetrans_v31 (--smoke: smoke)"
  )
  ap.add_argument("--set", action="append", default=[], help="KEY=VALUE")
  ap.add_argument("--variants", default=None)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--calls", type=int, default=BATCHES * 2)
  ap.add_argument("--trace-steps", type=int, default=BATCHES)
  ap.add_argument("--smoke", action="store_true", help="CPU dry run")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  smoke = args.smoke
  if smoke:
    common.TIMING.update(iters=1, repeats=1, rounds=1)
    # Any config, shrunk to CPU size (its model family and options kept).
    args.config = args.config or "smoke"
    args.rounds, args.calls = 1, 1
    args.set = [
      "model.d_model=32",
      "model.num_layers=1",
      "model.num_heads=4",
      "model.cross_layers=1",
      "model.head_hidden=32",
      "data.max_seq_len=32",
      "data.len_median=12",
      "data.requests_per_shard=4",
      "data.token_capacity=160",
      "data.cand_capacity=48",
      "data.max_cands=8",
      "data.num_items=5000",
      "data.num_categories=100",
      *args.set,
    ]
  args.config = args.config or "onetrans_v31"
  names = (args.variants or ("padded,ours" if smoke else DEFAULT)).split(",")
  base = config_lib.load(args.config, args.set)
  base = dataclasses.replace(
    base,
    data=dataclasses.replace(base.data, workers=0, prefetch=0),
    train=dataclasses.replace(base.train, progress=False),
    # One device, whatever mesh the config was written for.
    mesh=dataclasses.replace(base.mesh, cluster=1, zone=1, node=-1),
  )
  kind = common.device_name()
  print(f"jax {jax.__version__}, {kind}, config {args.config}", flush=True)
  factor = max(variant_config(base, n)[1] for n in names)
  it = data_loader.Loader(base.data, num_shards=1)
  shards = [_shard0(next(it)) for _ in range(BATCHES * factor)]
  it.close()
  t0 = time.perf_counter()
  variants = build_variants(base, names, shards, smoke)
  print(f"traced in {time.perf_counter() - t0:.1f} s; compiling", flush=True)
  variants = compile_all(variants)
  # One step each: finite losses, and padded == ours at equal parameters.
  first = {}
  for v in list(variants):
    state = v.state
    v.state = jax.tree.map(jnp.copy, state)
    try:
      first[v.name] = float(v(0))
    except Exception as e:  # noqa: BLE001 - report, time the others
      print(f"  {v.name}: FAILED to run: {type(e).__name__}: {e}"[:2000])
      variants.remove(v)
    v.state = state
    if not np.isfinite(first.get(v.name, 0.0)):
      print(f"  {v.name}: loss {first[v.name]}: left out")
      variants.remove(v)
  print("first-step losses:", first, flush=True)

  t = common.time_interleaved(
    {v.name: (v, [(i,) for i in range(BATCHES)]) for v in variants},
    rounds=args.rounds,
    calls=args.calls,
  )
  peak = flops_lib.device_peak(kind)
  records, rows = [], {}
  case = f"{args.config} {base.data.requests_per_shard} req/step" + (
    " " + " ".join(args.set) if args.set and not smoke else ""
  )
  for v in variants:
    counted = [flops_lib.step_flops(v.cfg, b) for b in v.host]
    fl = np.mean([c.train for c in counted])
    model_cfg = remat_lib.resolve(v.cfg).model
    hw = np.mean([c.train + c.recompute(model_cfg) for c in counted])
    reqs = np.mean([_real_requests(b) for b in v.host])
    toks = np.mean([int(b.offsets[..., -1].sum()) for b in v.host])
    sec = t[v.name]
    rows[v.name] = {
      "step_ms": sec * 1e3,
      "requests_per_s": reqs / sec,
      "tokens_per_s": toks / sec,
      "model_tflops_per_s": fl / sec / 1e12,
      "hardware_tflops_per_s": hw / sec / 1e12,
      "mfu": None if peak is None else fl / sec / peak,
      "memory_gb": (compiled_bytes(v.compiled) or 0) / 1e9,
      "requests_per_step": reqs,
      "tokens_per_step": toks,
      "model_tflop_per_step": fl / 1e12,
      "compile_s": v.compile_s,
      "first_loss": first[v.name],
    }
  pad = rows.get("padded")
  if pad and "ours" in rows:
    # The padded model is the same function: equal first losses (f32 on
    # CPU: to rounding; bf16 on the GPU: to bf16 tolerance).
    diff = abs(pad["first_loss"] - rows["ours"]["first_loss"])
    records.append(
      common.record(
        NAME,
        case,
        "padded",
        "first_loss_rel_diff",
        diff / abs(rows["ours"]["first_loss"]),
        goal=1e-2,
        lower_is_better=True,
      )
    )
  for name, r in rows.items():
    rec = functools.partial(common.record, NAME, case, name)
    records.append(rec("step_ms", r["step_ms"], lower_is_better=True))
    # Against the padded model where it ran, else a knob against `ours`
    # (gem_base has no padded variant; its FP8 goal is over bf16).
    base_name = "padded" if pad else "ours"
    if name != base_name and base_name in rows:
      goal = {"ours": GOAL_SPEEDUP, "fp8": GOAL_FP8 if not pad else None}
      records.append(
        rec(
          "requests_per_s",
          r["requests_per_s"],
          baseline=base_name,
          baseline_value=rows[base_name]["requests_per_s"],
          goal=goal.get(name),
        )
      )
    else:
      records.append(rec("requests_per_s", r["requests_per_s"]))
    records.append(rec("tokens_per_s", r["tokens_per_s"]))
    records.append(rec("model_tflops_per_s", r["model_tflops_per_s"]))
    if r["hardware_tflops_per_s"] > r["model_tflops_per_s"]:
      records.append(rec("hardware_tflops_per_s", r["hardware_tflops_per_s"]))
    if r["mfu"] is not None:
      records.append(
        rec(
          "local_mfu",
          r["mfu"],
          goal=GOAL_MFU
          if (name, args.config) == ("ours", "onetrans_v31")
          else None,
        )
      )
    records.append(rec("memory_gb", r["memory_gb"], lower_is_better=True))
  print()
  hdr = ("variant", "step ms", "req/s", "tok/s", "TFLOP/s", "MFU", "mem GB")
  print(" | ".join(hdr))
  for name, r in rows.items():
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
    print(
      f"{name} | {r['step_ms']:.2f} | {r['requests_per_s']:,.0f} | "
      f"{r['tokens_per_s']:,.0f} | {r['model_tflops_per_s']:.1f} | {mfu} | "
      f"{r['memory_gb']:.2f}"
    )
  # Saved now and again at the end: a trace that fails keeps these.
  common.write_results(NAME, records, args.out, dry_run=smoke)
  traces = {}
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      gb = stats["peak_bytes_in_use"] / 1e9
      print(f"device peak memory (process, all variants): {gb:.2f} GB")
    cub = cublas_peak()
    print(
      f"cuBLAS bf16 8192^3: {cub:.0f} TFLOP/s measured, "
      f"datasheet {peak / 1e12 if peak else float('nan'):.0f}",
      flush=True,
    )
    records.append(
      common.record(NAME, "bf16 matmul 8192^3", "cublas", "tflops", cub)
    )
  for v in variants:
    keep = None
    if args.out and on_gpu and v.name in ("ours", "padded"):
      keep = os.path.join(args.out, f"trace_{v.name}.json.gz")
    device = "/device:GPU" if on_gpu else "/host:CPU"
    try:
      traces[v.name] = tr = trace_breakdown(v, args.trace_steps, keep, device)
    except Exception as e:  # noqa: BLE001 - report, trace the others
      print(f"  {v.name}: trace FAILED: {type(e).__name__}: {e}"[:2000])
      continue
    # Record the view that leaves the smaller share uncategorized.
    seen = [b for b in tr.values() if b["busy_ms"] > 0]
    if not (on_gpu and seen):
      continue
    best = min(seen, key=lambda b: b["ms"]["other"] / b["busy_ms"])
    for cat, ms in best["ms"].items():
      records.append(
        common.record(
          NAME, case, v.name, f"trace_{cat}_ms", ms, lower_is_better=True
        )
      )
  for name, views in traces.items():
    for how, tr in views.items():
      parts = ", ".join(f"{c} {ms:.2f}" for c, ms in tr["ms"].items())
      print(
        f"trace {name} ({how}): busy {tr['busy_ms']:.2f} ms/step, "
        f"{tr['events']:.0f} events, {tr['with_hlo_metadata']:.0%} with "
        f"HLO metadata: {parts}"
      )
      for c, top in tr["top"].items():
        if top:
          print(f"    {c}: " + "; ".join(f"{k} {ms:.2f}" for k, ms in top))
  if args.out:
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    detail = {"rows": rows, "traces": traces}
    with gzip.open(
      pathlib.Path(args.out) / "train_step_detail.json.gz", "wt"
    ) as f:
      json.dump(detail, f)
  common.write_results(NAME, records, args.out, dry_run=smoke)


DEFAULT = "padded,ours,fp8,remat-dots,batch8x,batch8x+remat-nothing"


def _real_requests(b) -> int:
  lens = np.diff(b.offsets, axis=-1)
  cands = np.diff(b.cand_offsets, axis=-1)
  return int(np.sum((lens > 0) | (cands > 0)))


if __name__ == "__main__":
  main()
