"""Typed, frozen configs and the `--set key=value` override mechanism.

A run is described by one `Config`: `model`, `data`, `train`, `mesh`. Named
configs live in `configs/<name>.py`, each exporting `get_config()`, and are
loaded by path (`load`), so the library does not depend on the app; variants
are made with `dataclasses.replace` or overrides such as
`--set model.d_model=512 --set train.steps=200`. An override names a field
path, of any depth (`model.fp8.format=deepseek`); a typo or a value of the
wrong type fails at once and lists the valid keys. A field typed `Literal`
takes only its listed values, from `--set` and from Python alike.

Settings that form a family are a frozen sub-config of their own:
`model.attention` (`AttentionConfig`: which attention op runs and how) and
`model.fp8` (`Fp8Config`: G4 FP8 matmuls). Their fields were once flat
`ModelConfig` fields (`model.seq_attention`, `model.fp8`, ...): `MOVED`
maps each old key to its new one, so `--set` of an old key fails naming
the new key, and `from_dict` reads a checkpoint, run log or export that
stores the flat layout (`upgrade`).
"""

import copy
import dataclasses
import importlib.util
import os
import pathlib
import types
import typing

from gemjax.data.config import TASKS, DataConfig, checker

__all__ = [
  "AttentionConfig",
  "Config",
  "DataConfig",
  "Fp8Config",
  "MeshConfig",
  "ModelConfig",
  "TrainConfig",
]


Dtype = typing.Literal["float32", "bfloat16", "float16"]
# A kernel family's implementation (`pallas_kernels.dispatch`); None = the
# best for the platform.
Implementation = typing.Literal["xla", "mosaic"] | None
Fp8Format = typing.Literal["off", "deepseek", "mxfp8"]
Fp8Family = typing.Literal["attn", "ffn", "input", "heads"]
SeqAttention = typing.Literal["softmax", "block", "sliding"]
CandAttention = typing.Literal["softmax", "gdpa"]
SavedActivations = typing.Literal["compute", "fp8"]
GdpaActivation = typing.Literal["gelu", "gelu_tanh", "silu"]


def _optional(hint):
  """`hint` without its `| None`, if it has one."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1:
      return args[0]
  return hint


def _choices(hint) -> tuple | None:
  """The values of a `Literal` field, or of its optional or tuple form (the
  elements' values); None for any other type."""
  base = _optional(hint)
  elem = typing.get_args(base)[0] if typing.get_origin(base) is tuple else base
  if typing.get_origin(elem) is not typing.Literal:
    return None
  return typing.get_args(elem) + ((None,) if base is not hint else ())


# Keys of the flat `ModelConfig` that moved into its sub-configs, old -> new.
# `--set` of an old key fails naming the new one; `from_dict` moves them
# (`upgrade`), so a checkpoint, run log or export that stores the flat
# layout still loads.
MOVED = {
  "model.fp8": "model.fp8.format",
  **{
    f"model.fp8_{name}": f"model.fp8.{name}"
    for name in (
      "layers",
      "keep_last",
      "hadamard",
      "weight_grads",
      "implementation",
    )
  },
  "model.seq_attention": "model.attention.seq",
  "model.cand_attention": "model.attention.cand",
  "model.attention_implementation": "model.attention.implementation",
  **{
    f"model.{name}": f"model.attention.{name}"
    for name in (
      "block_size",
      "sliding_window",
      "causal",
      "rope",
      "rope_theta",
      "gdpa_activation",
      "gdpa_normalize",
    )
  },
}


def check_choices(cfg, section: str):
  """`checker(cfg, section)`, once every field typed `Literal` (alone,
  optional or as a tuple's elements) holds one of its values and every
  sub-config field holds its class; a failure reads like the other checks."""
  c = checker(cfg, section)
  for name, hint in typing.get_type_hints(type(cfg)).items():
    value = getattr(cfg, name)
    if dataclasses.is_dataclass(hint):
      key = f"{section}.{name}"
      note = f" ({key} is now {MOVED[key]})" if key in MOVED else ""
      c(name, isinstance(value, hint), f"{hint.__name__}{note}")
      continue
    choices = _choices(hint)
    if choices is None:
      continue
    if typing.get_origin(_optional(hint)) is tuple:
      c(name, set(value) <= set(choices), f"names from {choices}")
    else:
      c(name, value in choices, f"one of {choices}")
  return c


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """G4 FP8 matmuls (`pallas_kernels.fp8`, layer: `layers.Fp8Dense`)."""

  # "off", "deepseek" (1x128 activation / 128x128 weight blocks, the Hopper
  # default) or "mxfp8" (32x32 blocks). Forward and dX in FP8, dW in BF16.
  format: Fp8Format = "off"
  # Layer families computed in FP8 when `format` is on: "attn" (Q/K/V/O) and
  # "ffn" (SwiGLU) of the SeqFormer and cross blocks; "input" (token,
  # candidate and dense projections) and "heads" (the shared bottom MLP)
  # are opt-in. The per-task towers always stay f32.
  layers: tuple[Fp8Family, ...] = ("attn", "ffn")
  # The last N blocks of the depth (SeqFormer blocks, then cross blocks,
  # in construction order) stay in the compute dtype: the seed keeps the
  # error-sensitive last layers in BF16. The default 1 is the cross block.
  keep_last: int = 1
  hadamard: int = 0  # random Hadamard block before quantizing; 0 = off
  # Weight gradients in FP8 too (default BF16: the seed keeps dW, whose
  # outliers are worse, in higher precision).
  weight_grads: bool = False
  implementation: Implementation = None

  def __post_init__(self):
    c = check_choices(self, "model.fp8")
    c("keep_last", self.keep_last >= 0, ">= 0")
    c("hadamard", self.hadamard >= 0, ">= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Which attention op runs and how (`pallas_kernels`, `model.attention`).

  The family is what leaves the parameters as they are (a checkpoint's
  weights fit any of it); what adds parameters (`qk_norm`,
  `pooled_queries`, the head counts) is a `ModelConfig` field.
  """

  # SeqFormer self-attention: "softmax" (jagged flash attention, G1),
  # "block" (softmax inside `block_size`-position blocks, RoPE fused, G3) or
  # "sliding" (keys within `sliding_window` positions, the jagged kernel's
  # window; the seed's intermediate step).
  seq: SeqAttention = "softmax"
  block_size: typing.Literal[32, 64, 128] = 64
  sliding_window: int = 64
  causal: bool = False  # SeqFormer self-attention
  rope: bool = True  # RoPE at in-sequence positions, SeqFormer only
  rope_theta: float = 10_000.0
  # Candidate cross-attention and the pooled queries: "softmax", or "gdpa"
  # (activation attention, G2) with `gdpa_activation` and `gdpa_normalize`
  # (None, or "hstu": divide by the number of keys).
  cand: CandAttention = "softmax"
  gdpa_activation: GdpaActivation = "gelu_tanh"
  gdpa_normalize: typing.Literal["hstu"] | None = None
  implementation: Implementation = None

  def __post_init__(self):
    c = check_choices(self, "model.attention")
    c("sliding_window", self.sliding_window >= 1, ">= 1")
    c("rope_theta", self.rope_theta > 0, "> 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  d_model: int = 64
  num_layers: int = 2  # distinct stage-1 blocks
  layer_order: tuple[int, ...] = ()  # O6: () = 0..num_layers-1
  num_heads: int = 8  # O7 GQA: 8 query heads ...
  num_kv_heads: int = 2  # ... share 2 KV heads
  head_dim: int = 0  # 0 = d_model // num_heads
  ffn_mult: float = 8 / 3  # SwiGLU width / d_model
  qk_norm: bool = True  # O8
  cross_layers: int = 1  # stage-2 candidate -> sequence blocks
  emb_dim: int = 32  # one slice per table (O9), a multiple of 32
  head_hidden: tuple[int, ...] = (128, 64)
  dhen_layers: int = 0  # G6: DHEN expert layers before the heads (0 = off)
  dropout: float = 0.0  # heads' bottom MLP
  tasks: tuple[typing.Literal[TASKS], ...] = ("ctr", "cvr")
  dtype: Dtype = "float32"  # compute dtype; parameters stay float32
  attention: AttentionConfig = AttentionConfig()
  fp8: Fp8Config = Fp8Config()
  # Pooled attention (G2): this many learned queries compress each request's
  # history by GDPA into vectors added to the request's user vector; 0 = off.
  pooled_queries: int = 0
  # G9 activation checkpointing per region (`gemjax.model.remat`): entries
  # `region=policy`, e.g. ("seq=nothing", "heads=dots"); unnamed regions
  # save everything. `train.activation_budget_gb` fills in the rest.
  remat: tuple[str, ...] = ()
  # G9: what the dense layers keep of their inputs for the backward (and
  # SwiGLU of its gate and up outputs), in regions that keep activations
  # (remat policy `all`): "compute" (the compute dtype) or "fp8" (e4m3 in
  # 1x128 blocks, about half of bf16; `gemjax.model.layers`).
  saved_activations: SavedActivations = "compute"

  def __post_init__(self):
    c = check_choices(self, "model")
    for name in ("d_model", "num_layers", "num_heads", "num_kv_heads"):
      c(name, getattr(self, name) >= 1, ">= 1")
    c(
      "num_kv_heads",
      self.num_heads % self.num_kv_heads == 0,
      f"a divisor of num_heads={self.num_heads} (GQA groups)",
    )
    c("head_dim", self.head_dim >= 0, ">= 0 (0 = d_model // num_heads)")
    if not self.head_dim:
      c(
        "d_model",
        self.d_model % self.num_heads == 0,
        f"a multiple of num_heads={self.num_heads}, or set head_dim",
      )
    c(
      "layer_order",
      all(0 <= i < self.num_layers for i in self.layer_order),
      f"block indices in [0, num_layers={self.num_layers})",
    )
    c("ffn_mult", self.ffn_mult > 0, "> 0")
    c("cross_layers", self.cross_layers >= 0, ">= 0")
    c(
      "emb_dim",
      self.emb_dim >= 32 and self.emb_dim % 32 == 0,
      "a multiple of 32",
    )
    c("head_hidden", all(h >= 1 for h in self.head_hidden), "all >= 1")
    c("dhen_layers", self.dhen_layers >= 0, ">= 0")
    c("dropout", 0 <= self.dropout < 1, "in [0, 1)")
    c(
      "tasks",
      len(self.tasks) >= 1 and len(set(self.tasks)) == len(self.tasks),
      f"distinct names of {TASKS}, at least one",
    )
    c("pooled_queries", self.pooled_queries >= 0, ">= 0")
    if self.remat:  # the model's names; an exported scorer has no model
      from gemjax.model import remat

      try:
        remat.parse(self.remat)
      except ValueError as e:
        c("remat", False, "entries " + str(e).partition(": ")[2])

  @property
  def attn_head_dim(self) -> int:
    """`head_dim`, or `d_model // num_heads` when it is 0 (auto)."""
    return self.head_dim or self.d_model // self.num_heads


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  learning_rate: float = 2e-3  # AdamW peak, dense parameters
  warmup_steps: int = 30
  weight_decay: float = 0.01
  embedding_learning_rate: float = 0.003  # row-wise Adagrad, tables
  # Adagrad's starting accumulator, in units of the squared gradient. The loss
  # is a mean over the batch, so one row's gradient is tiny (~1e-4): a large
  # start (TF's 0.1) would freeze the tables for thousands of steps.
  embedding_initial_accumulator: float = 1e-6
  grad_clip_norm: float = 1.0
  seed: int = 0
  log_every: int = 10
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  eval_batches: int = 0  # 0 = the whole held-out set
  # Real logs: score the in-project baselines (`gemjax.baselines`) on the
  # same held-out examples and print them beside the model.
  baselines: bool = True
  run_dir: str = "runs/{config}"
  progress: bool = True  # live progress line on stderr
  # Resuming a run whose checkpoint was written under another model or data
  # config is refused (the checkpoint would not fit, or the data would
  # silently change); this lets it go on anyway.
  allow_config_change: bool = False
  # G9: estimated bytes of saved activations per device allowed; the
  # regions' checkpoint policies are chosen to fit, recompute saved per GB
  # first (`gemjax.train.remat`). 0 = off (`model.remat` as given).
  activation_budget_gb: float = 0.0

  def __post_init__(self):
    c = checker(self, "train")
    for name in ("steps", "log_every", "checkpoint_every", "keep_checkpoints"):
      c(name, getattr(self, name) >= 1, ">= 1")
    for name in ("warmup_steps", "eval_batches"):
      c(name, getattr(self, name) >= 0, ">= 0")
    for name in ("learning_rate", "embedding_learning_rate"):
      c(name, getattr(self, name) >= 0, ">= 0")
    c("weight_decay", self.weight_decay >= 0, ">= 0")
    c(
      "embedding_initial_accumulator",
      self.embedding_initial_accumulator > 0,
      "> 0",
    )
    c("grad_clip_norm", self.grad_clip_norm > 0, "> 0")
    c("activation_budget_gb", self.activation_budget_gb >= 0, ">= 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Devices per network tier, slowest first; -1 = whatever is left."""

  cluster: int = 1
  zone: int = 1
  node: int = -1
  strategy: str = "fsdp"  # a rule table in sharding.rules
  # Data-parallel shards per step (jagged batches of `data.requests_per_shard`
  # each), a multiple of the device count; 0 = one per device. Fixing it makes
  # the global batch, and so the math, independent of the device count.
  data_shards: int = 0

  def __post_init__(self):
    c = checker(self, "mesh")
    sizes = (self.cluster, self.zone, self.node)
    for name, size in zip(("cluster", "zone", "node"), sizes, strict=True):
      c(name, size >= 1 or size == -1, ">= 1, or -1 for what is left")
    c("node", sizes.count(-1) <= 1, "-1 in at most one tier")
    c("data_shards", self.data_shards >= 0, ">= 0 (0 = one per device)")
    # The names only: sharding.rules owns the tables (imported here, not at
    # the top, so that configs stay importable without the sharding stack).
    from sharding.rules import STRATEGIES

    c("strategy", self.strategy in STRATEGIES, f"one of {tuple(STRATEGIES)}")


@dataclasses.dataclass(frozen=True)
class Config:
  name: str = "unnamed"
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  mesh: MeshConfig = MeshConfig()


# Named configs are files, loaded by path: the library never imports the
# app's `configs/` folder. Relative to the working directory, which is the
# repository root for `make`, the CLIs, the tests and the notebooks.
CONFIGS_DIR = pathlib.Path("configs")


def available_configs(directory: str | os.PathLike = CONFIGS_DIR) -> list[str]:
  """The config names in `directory`: its `*.py` files not starting `_`."""
  return sorted(
    p.stem
    for p in pathlib.Path(directory).glob("*.py")
    if not p.name.startswith("_")
  )


def load(
  name: str | os.PathLike,
  overrides: typing.Sequence[str] = (),
  directory: str | os.PathLike = CONFIGS_DIR,
) -> Config:
  """`get_config()` of `<directory>/<name>.py`, or of the file `name` when
  it ends in `.py`, with `key=value` overrides; named after the file."""
  path = pathlib.Path(name)
  if path.suffix != ".py":
    names = available_configs(directory)
    if str(name) not in names:
      where = pathlib.Path(directory).resolve()
      listed = ", ".join(names) or "none (run from the repository root?)"
      raise ValueError(
        f"unknown config {str(name)!r} in {where}; available: {listed}"
      )
    path = pathlib.Path(directory) / f"{name}.py"
  elif not path.is_file():
    raise ValueError(f"no config file {path}")
  cfg = dataclasses.replace(_module(path).get_config(), name=path.stem)
  return apply_overrides(cfg, overrides)


def _module(path: pathlib.Path) -> types.ModuleType:
  """The Python file at `path`, run as a module of its own."""
  spec = importlib.util.spec_from_file_location(
    f"gemjax_config_{path.stem}", path
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def apply_overrides(cfg, overrides: typing.Sequence[str]):
  """`cfg` with `key=value` overrides, all applied at once (so checks that
  relate fields, such as `num_categories <= num_items`, see the final
  values, whatever the order of the overrides)."""
  updates: dict = {}
  for item in overrides:
    key, sep, raw = item.partition("=")
    if not sep:
      raise ValueError(f"override {item!r} must look like key=value")
    key = key.strip()
    if key in MOVED:
      raise ValueError(
        f"config key {key!r} is now {MOVED[key]!r}: "
        f"--set {MOVED[key]}={raw.strip()}"
      )
    try:
      path, value = _resolve(cfg, key.split("."), raw.strip(), key)
    except KeyError:
      raise ValueError(
        f"unknown config key {key!r}; valid keys: {', '.join(valid_keys(cfg))}"
      ) from None
    node = updates
    for name in path[:-1]:
      node = node.setdefault(name, {})
    node[path[-1]] = value
  return _replace(cfg, updates)


def valid_keys(cfg, prefix: str = "") -> list[str]:
  out = []
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if dataclasses.is_dataclass(v):
      out += valid_keys(v, f"{prefix}{f.name}.")
    else:
      out.append(f"{prefix}{f.name}")
  return out


def _resolve(obj, path, raw, full_key):
  """Check `path` names a leaf field of `obj`; parse `raw` to its type."""
  fields = {f.name for f in dataclasses.fields(obj)}
  head = path[0]
  if head not in fields:
    raise KeyError(full_key)
  current = getattr(obj, head)
  if dataclasses.is_dataclass(current):
    if len(path) == 1:
      raise ValueError(f"{full_key!r} is a section; set one of its fields")
    sub, value = _resolve(current, path[1:], raw, full_key)
    return [head, *sub], value
  if len(path) > 1:
    raise KeyError(full_key)
  hint = typing.get_type_hints(type(obj))[head]
  try:
    return [head], _parse(raw, hint)
  except (TypeError, ValueError) as e:
    choices = _choices(hint)
    if choices is not None:
      many = typing.get_origin(_optional(hint)) is tuple
      allowed = f"{'names from' if many else 'one of'} {choices}"
      raise ValueError(f"{full_key}={raw!r}: must be {allowed}") from None
    raise ValueError(f"{full_key}={raw!r}: expected {hint}: {e}") from None


def _replace(obj, updates: dict):
  return dataclasses.replace(
    obj,
    **{
      k: _replace(getattr(obj, k), v) if isinstance(v, dict) else v
      for k, v in updates.items()
    },
  )


def _parse(raw: str, hint):
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(hint)
    if raw.lower() in ("none", "null") and type(None) in args:
      return None
    hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
  if origin is tuple:
    (elem, *_) = typing.get_args(hint)
    parts = [p for p in raw.strip("()[] ").split(",") if p.strip()]
    return tuple(_parse(p.strip(), elem) for p in parts)
  if origin is typing.Literal:
    # By its written form, so that `64` names the int choice 64.
    for choice in typing.get_args(hint):
      if raw == str(choice):
        return choice
    raise ValueError("not a choice")
  if hint is bool:
    if raw.lower() in ("true", "1", "yes"):
      return True
    if raw.lower() in ("false", "0", "no"):
      return False
    raise ValueError("not a bool")
  if hint in (int, float, str):
    return hint(raw)
  raise TypeError(f"cannot parse {hint}")


def upgrade(d: dict) -> dict:
  """A copy of `d` (a `to_dict` dict, as JSON stores it) with every key of
  `MOVED` at its new place; a dict of the current layout comes back equal."""
  d = copy.deepcopy(d)
  found = {}
  for old, new in MOVED.items():
    section, name = old.split(".")
    fields = d.get(section)
    # `model.fp8` holding a dict is the current layout's section.
    if (
      isinstance(fields, dict)
      and name in fields
      and not isinstance(fields[name], dict)
    ):
      found[new] = (old, fields.pop(name))
  for new, (old, value) in found.items():
    section, *path, name = new.split(".")
    node = d[section]
    for part in path:
      node = node.setdefault(part, {})
    if name in node:
      raise ValueError(f"config dict has both {old!r} and {new!r}")
    node[name] = value
  return d


def to_dict(cfg: Config) -> dict:
  """A JSON-serializable dict of `cfg` (tuples become lists)."""
  return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
  """The `Config` that `to_dict` wrote (a checkpoint's or a run log's).

  Keys must be fields: a dict from another version of the code (a field
  renamed or removed) fails naming the key, instead of being read as
  something else. Fields missing from `d` take their defaults. A dict of
  the flat model layout (`model.fp8`, `model.seq_attention`, ...) is read
  through `upgrade`.
  """
  return _from_dict(Config, upgrade(d), "")


def _from_dict(cls, d: dict, prefix: str):
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(
      f"config dict has unknown key {prefix + unknown[0]!r}; valid keys: "
      + ", ".join(f"{prefix}{n}" for n in sorted(names))
    )
  kw = {}
  for name, value in d.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      kw[name] = _from_dict(hint, value, f"{prefix}{name}.")
    else:
      kw[name] = _as_type(value, hint)
  return cls(**kw)


def _as_type(value, hint):
  """JSON value -> `hint` (lists back to tuples, nested ones too)."""
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None:
      return None
    hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin = typing.get_origin(hint)
  if origin is tuple and isinstance(value, list):
    args = typing.get_args(hint)
    elem = args[0] if args else typing.Any
    if len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis):
      return tuple(_as_type(v, elem) for v in value)
    return tuple(_as_type(v, a) for v, a in zip(value, args, strict=True))
  return value
