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
