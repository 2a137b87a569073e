"""Named configs and `--set` overrides."""

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
      "model.rope=false",
      "model.attention_implementation=none",
    ],
  )
  assert cfg.model.d_model == 96 and cfg.model.attn_head_dim == 12
  assert cfg.train.steps == 7
  assert cfg.model.layer_order == (0, 1, 1)
  assert cfg.model.rope is False
  assert cfg.model.attention_implementation is None


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
    ("model.rope=maybe", "not a bool"),
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
    ("model.tasks=ctr,foo", r"model.tasks=\('ctr', 'foo'\): must be distinct"),
    ("model.tasks=", r"model.tasks=\(\): must be distinct names of"),
    ("model.tasks=ctr,ctr", r"model.tasks=\('ctr', 'ctr'\)"),
    ("model.dtype=int8", "model.dtype='int8': must be one of"),
    ("model.seq_attention=x", "model.seq_attention='x': must be one of"),
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
