"""Named configs and `--set` overrides."""

import copy
import json
import pathlib

import pytest

from gemjax import config


def test_every_named_config_loads():
  names = config.available_configs()
  assert {"smoke", "onetrans_v31"} <= set(names)
  for name in names:
    cfg = config.load(name)
    assert cfg.name == name


def test_overrides_are_typed():
  cfg = config.load(
    "smoke",
    [
      "model.d_model=96",
      "train.steps=7",
      "model.layer_order=0,1,1",
      "model.attention.rope=false",
      "model.attention.implementation=none",
    ],
  )
  assert cfg.model.d_model == 96 and cfg.model.attn_head_dim == 12
  assert cfg.train.steps == 7
  assert cfg.model.layer_order == (0, 1, 1)
  assert cfg.model.attention.rope is False
  assert cfg.model.attention.implementation is None


def test_unknown_config_lists_the_valid_ones():
  with pytest.raises(ValueError, match="available: .*smoke"):
    config.load("smok")


@pytest.mark.parametrize(
  "item, match",
  [
    (
      "model.dmodel=3",
      "unknown config key 'model.dmodel'; valid keys: .*model.d_model",
    ),
    ("modle.d_model=3", "unknown config key 'modle.d_model'"),
    ("model=3", "is a section"),
    ("model.d_model=abc", "model.d_model='abc': expected"),
    ("model.attention.rope=maybe", "not a bool"),
    ("train.steps", "must look like key=value"),
  ],
)
def test_bad_override_fails_clearly(item, match):
  with pytest.raises(ValueError, match=match):
    config.load("smoke", [item])


def test_cli_rejects_bad_key(capsys):
  from gemjax.train.__main__ import main

  assert main(["--config", "smoke", "--set", "model.nope=1"]) == 2
  assert "valid keys" in capsys.readouterr().err


def test_related_fields_are_checked_after_all_overrides():
  """Shrinking two related tables works in either order."""
  for order in ([0, 1], [1, 0]):
    items = ["data.num_items=50", "data.num_categories=10"]
    cfg = config.load("onetrans_v31", [items[i] for i in order])
    assert (cfg.data.num_items, cfg.data.num_categories) == (50, 10)
  with pytest.raises(ValueError, match="num_categories"):
    config.load("smoke", ["data.num_categories=6000"])


def test_dict_round_trip_of_every_named_config():
  import json

  for name in config.available_configs():
    cfg = config.load(name, ["model.layer_order=0,1,1"])
    back = config.from_dict(json.loads(json.dumps(config.to_dict(cfg))))
    assert back == cfg
    assert isinstance(back.data.quota[0], tuple)


def test_from_dict_names_an_unknown_key():
  d = config.to_dict(config.load("smoke"))
  d["model"]["dmodel"] = 3
  with pytest.raises(ValueError, match="unknown key 'model.dmodel'"):
    config.from_dict(d)


@pytest.mark.parametrize(
  "item, message",
  [
    ("model.d_model=0", "model.d_model=0: must be >= 1"),
    ("model.num_heads=0", "model.num_heads=0: must be >= 1"),
    ("model.num_kv_heads=0", "model.num_kv_heads=0: must be >= 1"),
    ("model.num_kv_heads=3", "model.num_kv_heads=3: must be a divisor of"),
    ("model.d_model=60", "model.d_model=60: must be a multiple of num_heads"),
    ("model.num_layers=0", "model.num_layers=0: must be >= 1"),
    ("model.layer_order=0,5", r"model.layer_order=\(0, 5\): must be block"),
    ("model.emb_dim=48", "model.emb_dim=48: must be a multiple of 32"),
    ("model.tasks=ctr,foo", r"model.tasks='ctr,foo': must be names from"),
    ("model.tasks=", r"model.tasks=\(\): must be distinct names of"),
    ("model.tasks=ctr,ctr", r"model.tasks=\('ctr', 'ctr'\)"),
    ("model.dtype=int8", "model.dtype='int8': must be one of"),
    ("model.attention.seq=x", "model.attention.seq='x': must be one of"),
    ("model.fp8.keep_last=-1", "model.fp8.keep_last=-1: must be >= 0"),
    ("model.attention.rope_theta=0", "model.attention.rope_theta=0.0: must be"),
    ("model.attention.sliding_window=0", "sliding_window=0: must be >= 1"),
    ("model.dropout=1", "model.dropout=1.0: must be in"),
    ("train.steps=0", "train.steps=0: must be >= 1"),
    ("train.steps=-1", "train.steps=-1: must be >= 1"),
    ("train.log_every=0", "train.log_every=0: must be >= 1"),
    ("train.checkpoint_every=0", "train.checkpoint_every=0: must be >= 1"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints=0: must be >= 1"),
    ("train.grad_clip_norm=0", "train.grad_clip_norm=0.0: must be > 0"),
    ("mesh.strategy=zero3", "mesh.strategy='zero3': must be one of .*'fsdp'"),
    ("mesh.node=0", "mesh.node=0: must be >= 1, or -1"),
    ("mesh.data_shards=-2", "mesh.data_shards=-2: must be >= 0"),
    ("data.requests_per_shard=0", "data.requests_per_shard=0: must be >= 1"),
    ("data.bbs_minibatch=0", "data.bbs_minibatch=0: must be >= 1"),
    (
      "data.source=parket",
      "data.source='parket': must be one of .*'synthetic', 'movielens'",
    ),
    ("data.dedup=all", "data.dedup='all': must be one of .*'item_action'"),
    ("data.batching=x", r"data.batching='x': must be one of \('bbs', 'rand"),
    ("data.token_capacity=8", "data.token_capacity=8: must be >= max_seq_len"),
    ("data.requests_per_shard=30", "must be a multiple of bbs_minibatch=4"),
  ],
)
def test_bad_value_fails_at_once_naming_field_value_and_choices(item, message):
  """Each bad value fails when the config is made, before anything is built,
  in one line: the field, the value, and what is allowed."""
  with pytest.raises(ValueError, match=message) as e:
    config.load("smoke", [item])
  assert "\n" not in str(e.value)


def test_cli_reports_a_bad_value_in_one_line(capsys):
  from gemjax.train.__main__ import main

  assert main(["--config", "smoke", "--set", "train.steps=0"]) == 2
  assert capsys.readouterr().err == "error: train.steps=0: must be >= 1\n"


def test_configs_load_by_path_from_any_directory(tmp_path):
  """The library reads config files; it never imports the `configs` folder."""
  (tmp_path / "mine.py").write_text(
    "import dataclasses\n"
    "from gemjax import config\n"
    "def get_config():\n"
    "  cfg = config.load('configs/smoke.py')\n"
    "  return dataclasses.replace(cfg, train=dataclasses.replace(\n"
    "    cfg.train, steps=3))\n"
  )
  by_name = config.load("mine", ["train.seed=5"], directory=tmp_path)
  by_path = config.load(tmp_path / "mine.py", ["train.seed=5"])
  assert by_name == by_path
  assert (by_name.name, by_name.train.steps, by_name.train.seed) == (
    "mine",
    3,
    5,
  )
  assert config.available_configs(tmp_path) == ["mine"]
  with pytest.raises(ValueError, match="unknown config 'smoke' in .*: mine"):
    config.load("smoke", directory=tmp_path)
  with pytest.raises(ValueError, match="no config file"):
    config.load(tmp_path / "nope.py")


# ---------------------------------------------------------------------------
# Sub-configs (`model.attention`, `model.fp8`): nested keys, `Literal`
# choices, the keys of the flat layout and its stored configs.
# ---------------------------------------------------------------------------


def test_nested_overrides_set_sub_config_fields():
  cfg = config.load(
    "smoke",
    [
      "model.fp8.format=deepseek",
      "model.fp8.layers=attn,heads",
      "model.fp8.keep_last=0",
      "model.attention.seq=block",
      "model.attention.block_size=32",
      "model.attention.gdpa_normalize=hstu",
      "model.attention.implementation=xla",
    ],
  )
  assert cfg.model.fp8 == config.Fp8Config(
    format="deepseek", layers=("attn", "heads"), keep_last=0
  )
  assert cfg.model.attention == config.AttentionConfig(
    seq="block", block_size=32, gdpa_normalize="hstu", implementation="xla"
  )
  assert type(cfg.model.attention.block_size) is int
  assert cfg.model.d_model == config.load("smoke").model.d_model


def test_overrides_reach_any_depth():
  """The parser knows no section names: a tree four deep takes a key four
  deep, with its `Literal` enforced there too."""
  import dataclasses
  import typing

  @dataclasses.dataclass(frozen=True)
  class Leaf:
    kind: typing.Literal["a", "b"] = "a"

  @dataclasses.dataclass(frozen=True)
  class Mid:
    leaf: Leaf = Leaf()
    n: int = 1

  @dataclasses.dataclass(frozen=True)
  class Top:
    mid: Mid = Mid()

  @dataclasses.dataclass(frozen=True)
  class Root:
    top: Top = Top()

  got = config.apply_overrides(Root(), ["top.mid.leaf.kind=b", "top.mid.n=3"])
  assert got == Root(Top(Mid(Leaf("b"), 3)))
  with pytest.raises(ValueError, match=r"top.mid.leaf.kind='c': must be one"):
    config.apply_overrides(Root(), ["top.mid.leaf.kind=c"])
  with pytest.raises(ValueError, match="'top.mid.leaf' is a section"):
    config.apply_overrides(Root(), ["top.mid.leaf=b"])
  with pytest.raises(ValueError, match="unknown config key 'top.mid.leaf.x'"):
    config.apply_overrides(Root(), ["top.mid.leaf.x=b"])


@pytest.mark.parametrize(
  "item, message",
  [
    (
      "model.fp8.format=fp4",
      r"model.fp8.format='fp4': must be one of \('off', 'deepseek', 'mxfp8'\)",
    ),
    (
      "model.fp8.layers=attn,embeddings",
      r"model.fp8.layers='attn,embeddings': must be names from \('attn', "
      r"'ffn', 'input', 'heads'\)",
    ),
    (
      "model.fp8.implementation=cuda",
      r"model.fp8.implementation='cuda': must be one of \('xla', 'mosaic', "
      r"None\)",
    ),
    (
      "model.attention.seq=flash",
      r"model.attention.seq='flash': must be one of \('softmax', 'block', "
      r"'sliding'\)",
    ),
    (
      "model.attention.cand=block",
      r"model.attention.cand='block': must be one of \('softmax', 'gdpa'\)",
    ),
    (
      "model.attention.block_size=48",
      r"model.attention.block_size='48': must be one of \(32, 64, 128\)",
    ),
    (
      "model.attention.gdpa_activation=relu",
      r"model.attention.gdpa_activation='relu': must be one of \('gelu', ",
    ),
    (
      "model.attention.gdpa_normalize=mean",
      r"model.attention.gdpa_normalize='mean': must be one of \('hstu', None\)",
    ),
    (
      "model.dtype=int8",
      r"model.dtype='int8': must be one of \('float32', 'bfloat16', 'float16'",
    ),
  ],
)
def test_set_enforces_literal_choices(item, message):
  """A `Literal` field fails at parse time naming the key, the value given
  and every allowed value, in one line."""
  with pytest.raises(ValueError, match=message) as e:
    config.load("smoke", [item])
  assert "\n" not in str(e.value)


def test_literal_choices_hold_outside_set_too():
  """Configs made in Python (named configs, `dataclasses.replace`) are
  checked the same way."""
  import dataclasses

  with pytest.raises(ValueError, match="model.attention.seq='flash': must be"):
    config.AttentionConfig(seq="flash")
  with pytest.raises(ValueError, match=r"model.fp8.layers=\('x',\): must be"):
    config.Fp8Config(layers=("x",))
  with pytest.raises(ValueError, match="model.dtype='int8': must be one of"):
    config.ModelConfig(dtype="int8")
  with pytest.raises(ValueError, match=r"model.tasks=\('ctr', 'ctc'\): must"):
    config.ModelConfig(tasks=("ctr", "ctc"))
  model = config.ModelConfig()
  with pytest.raises(
    ValueError,
    match=r"model.fp8='deepseek': must be Fp8Config \(model.fp8 is now "
    r"model.fp8.format\)",
  ):
    dataclasses.replace(model, fp8="deepseek")


@pytest.mark.parametrize(
  "item, message",
  [
    (
      "model.fp8=deepseek",
      "config key 'model.fp8' is now 'model.fp8.format': "
      "--set model.fp8.format=deepseek",
    ),
    ("model.fp8_layers=attn", "'model.fp8_layers' is now 'model.fp8.layers'"),
    ("model.fp8_keep_last=0", "is now 'model.fp8.keep_last'"),
    ("model.fp8_implementation=xla", "is now 'model.fp8.implementation'"),
    (
      "model.seq_attention=block",
      "config key 'model.seq_attention' is now 'model.attention.seq': "
      "--set model.attention.seq=block",
    ),
    ("model.cand_attention=gdpa", "is now 'model.attention.cand'"),
    ("model.block_size=32", "is now 'model.attention.block_size'"),
    ("model.sliding_window=8", "is now 'model.attention.sliding_window'"),
    ("model.gdpa_normalize=hstu", "is now 'model.attention.gdpa_normalize'"),
    (
      "model.attention_implementation=xla",
      "is now 'model.attention.implementation'",
    ),
    ("model.rope=false", "is now 'model.attention.rope'"),
    ("model.causal=true", "is now 'model.attention.causal'"),
  ],
)
def test_old_flat_keys_name_the_new_one(item, message):
  with pytest.raises(ValueError, match=message):
    config.load("smoke", [item])


def test_moved_keys_lead_to_valid_keys():
  """Every old key is gone and every key it names exists, so the table and
  the dataclasses cannot drift apart."""
  keys = set(config.valid_keys(config.Config()))
  assert set(config.MOVED.values()) <= keys
  assert not set(config.MOVED) & keys


FLAT = pathlib.Path(__file__).with_name("flat_model_config.json")
# The overrides `flat_model_config.json` (the smoke config's `to_dict` in
# the flat layout, written by that code) was made with, in today's keys.
FLAT_OVERRIDES = [
  "model.fp8.format=deepseek",
  "model.fp8.layers=attn,ffn,heads",
  "model.fp8.keep_last=0",
  "model.fp8.hadamard=32",
  "model.fp8.weight_grads=true",
  "model.fp8.implementation=xla",
  "model.attention.seq=block",
  "model.attention.block_size=32",
  "model.attention.sliding_window=16",
  "model.attention.cand=gdpa",
  "model.attention.gdpa_activation=silu",
  "model.attention.gdpa_normalize=hstu",
  "model.pooled_queries=2",
  "model.attention.implementation=xla",
  "model.attention.rope_theta=500",
  "model.attention.causal=true",
]


def flat_layout(d: dict) -> dict:
  """A `to_dict` dict in the flat model layout that older checkpoints, run
  logs and exports store (written out here, not from `config.MOVED`)."""
  d = copy.deepcopy(d)
  model = d["model"]
  for name, value in model.pop("fp8").items():
    model["fp8" if name == "format" else f"fp8_{name}"] = value
  renamed = {
    "seq": "seq_attention",
    "cand": "cand_attention",
    "implementation": "attention_implementation",
  }
  for name, value in model.pop("attention").items():
    model[renamed.get(name, name)] = value
  return d


def test_a_flat_layout_config_dict_loads_upgraded():
  """A config stored by the flat layout's code (every moved field set off
  its default) reads back as the same config in the nested layout."""
  stored = json.loads(FLAT.read_text())
  want = config.load("smoke", FLAT_OVERRIDES)
  got = config.from_dict(stored)
  assert got.model == want.model
  assert got == config.Config(name="smoke", model=want.model)
  # `flat_layout` (used by the serving tests) writes that same layout.
  now = json.loads(json.dumps(config.to_dict(want)))
  # (less the fields added since that layout, which load as defaults).
  flat = flat_layout(now)["model"]
  added = {"saved_activations"}
  assert {k: v for k, v in flat.items() if k not in added} == stored["model"]
  # The current layout goes through unchanged.
  assert config.upgrade(now) == now
  both = copy.deepcopy(now)
  both["model"]["seq_attention"] = "softmax"
  with pytest.raises(ValueError, match="both 'model.seq_attention' and"):
    config.from_dict(both)


def test_resume_compares_a_flat_checkpoint_config_in_the_new_layout(tmp_path):
  """A checkpoint whose stored config has the flat layout resumes under the
  same config, and a real change is named by its new key; the runtime-only
  fields (`*.implementation`) may differ."""
  from gemjax.train.checkpoint import CannotResume
  from gemjax.train.loop import _check_resume

  cfg = config.load("smoke", FLAT_OVERRIDES)
  saved = json.loads(FLAT.read_text())
  saved["data"] = json.loads(json.dumps(config.to_dict(cfg)))["data"]
  _check_resume(cfg, tmp_path, saved)
  runtime = config.apply_overrides(
    cfg,
    ["model.attention.implementation=none", "model.fp8.implementation=none"],
  )
  _check_resume(runtime, tmp_path, saved)
  other = config.apply_overrides(
    cfg, ["model.attention.seq=softmax", "model.fp8.keep_last=1"]
  )
  with pytest.raises(CannotResume) as e:
    _check_resume(other, tmp_path, saved)
  assert 'model.attention.seq "block" -> "softmax"' in str(e.value)
  assert "model.fp8.keep_last 0 -> 1" in str(e.value)
  assert "unknown here" not in str(e.value)
