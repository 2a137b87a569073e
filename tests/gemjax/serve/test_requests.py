"""Request validation and the JSON codecs, without a server or a model:
every bad entry is named by its field, numbers are never coerced into ids,
the binary column form reads as the lists do and passes the same checks,
and the orjson and Python json paths give the same answers."""

import base64
import binascii
import functools
import json

import numpy as np
import pytest

from gemjax.data.config import ACTION_ID
from gemjax.serve import http, requests
from gemjax.serve.requests import (
  BINARY,
  CANDIDATES,
  HISTORY,
  RequestError,
  encode_column,
  parse_request,
)
from tests.gemjax.serve.conftest import tiny_config

DATA = tiny_config().data


def request():
  return {
    "user_row": 3,
    "ts": 1_000,
    "dense": [0.5] * DATA.num_dense,
    "history": {
      "ts": [10, 20, 20, 30],
      "item": [1, 2, 3, 4],
      "category": [0, 1, 1, 2],
      "action": [0, "click", 2, 0],
      "price": [1.5, 0, 2, 3.25],
    },
    "candidates": {"item": [5, 6], "category": [1, 2], "price": [1.0, 2]},
  }


def test_parse_gives_typed_columns():
  cols = parse_request(request(), DATA, DATA.num_dense)
  assert cols["hist_ts"].dtype == np.int64
  assert cols["hist_action"].dtype == np.int8
  assert cols["hist_action"].tolist() == [0, ACTION_ID["click"], 2, 0]
  assert cols["cand_price"].dtype == np.float32
  assert cols["cand_price"].tolist() == [1.0, 2.0]
  # numpy columns (library callers) take the same path.
  r = request()
  r["candidates"] = {k: np.asarray(v) for k, v in r["candidates"].items()}
  got = parse_request(r, DATA, DATA.num_dense)
  np.testing.assert_array_equal(got["cand_item"], cols["cand_item"])


@pytest.mark.parametrize(
  "path, value, field",
  [
    (("candidates", "item", 1), 6.0, "candidates.item[1]"),
    (("candidates", "item", 1), 2.5, "candidates.item[1]"),
    (("candidates", "item", 0), "5", "candidates.item[0]"),
    (("candidates", "item", 0), None, "candidates.item[0]"),
    (("candidates", "item", 1), [6], "candidates.item[1]"),
    (("candidates", "item", 1), 2**64, "candidates.item[1]"),
    (
      ("candidates", "category", 0),
      DATA.num_categories,
      "candidates.category[0]",
    ),
    (("history", "ts", 3), -1, "history.ts[3]"),
    (("history", "action", 1), "like", "history.action[1]"),
    (("history", "action", 1), 1.0, "history.action[1]"),
    (("history", "action", 1), 99, "history.action[1]"),
    (("history", "price", 2), float("inf"), "history.price[2]"),
    (("history", "price", 2), -0.5, "history.price[2]"),
    (("history", "price", 2), 10**400, "history.price[2]"),
    (("history", "price", 2), "1", "history.price[2]"),
    (("dense", 1), float("nan"), "dense[1]"),
  ],
)
def test_bad_entry_is_named(path, value, field):
  r = request()
  obj = r
  for k in path[:-1]:
    obj = obj[k]
  obj[path[-1]] = value
  with pytest.raises(RequestError) as e:
    parse_request(r, DATA, DATA.num_dense, "requests[0]")
  assert e.value.field == f"requests[0].{field}"


@pytest.fixture(params=["pybase64", "binascii"])
def b64(request, monkeypatch):
  """Both base64 decoders of `requests`: pybase64 when installed, and
  binascii's."""
  if request.param == "pybase64":
    pytest.importorskip("pybase64")
  else:
    monkeypatch.setattr(
      requests,
      "_b64decode",
      functools.partial(binascii.a2b_base64, strict_mode=True),
    )
  return request.param


def binary(r):
  """`r` with every history and candidate column in the binary form."""
  r = dict(r)
  for part, names in (("history", HISTORY), ("candidates", CANDIDATES)):
    r[part] = {k: encode_column(_ids(r[part][k], k), k) for k in names}
  return r


def _ids(vals, name):
  return [ACTION_ID.get(a, a) for a in vals] if name == "action" else vals


def test_binary_columns_read_as_the_lists(b64):
  want = parse_request(request(), DATA, DATA.num_dense)
  for r in (binary(request()), _mixed()):
    got = parse_request(r, DATA, DATA.num_dense)
    assert got.keys() == want.keys()
    for k, w in want.items():
      np.testing.assert_array_equal(got[k], w, err_msg=k)
      assert np.asarray(got[k]).dtype == np.asarray(w).dtype, k
  # Through JSON, as the server reads it.
  raw = json.dumps({"requests": [binary(request())]}).encode()
  parsed, _ = http.parse_body(http.decode_json(raw), DATA, DATA.num_dense, 1e3)
  np.testing.assert_array_equal(parsed[0]["hist_ts"], want["hist_ts"])


def _mixed():
  """Binary candidates beside a history of lists."""
  r = request()
  r["candidates"] = binary(r)["candidates"]
  return r


def _raw(arr, dtype):
  return base64.b64encode(np.asarray(arr, dtype).tobytes()).decode()


@pytest.mark.parametrize(
  "part, name, value, field",
  [
    ("candidates", "category", None, "candidates.category"),  # missing
    ("candidates", "item", 5, "candidates.item"),  # neither list nor string
    ("candidates", "item", "not base64!", "candidates.item"),
    ("candidates", "item", "BQAAAA", "candidates.item"),  # no padding
    ("candidates", "item", "BQAAAA==BQAAAA==", "candidates.item"),
    ("candidates", "item", "BQAAAA\n", "candidates.item"),
    ("candidates", "item", "BQAAAé==", "candidates.item"),
    ("candidates", "item", _raw([5, 6, 7], "u1"), "candidates.item"),  # 3 B
    ("candidates", "price", _raw([1.0], "<f4"), "candidates.price"),  # length
    ("candidates", "item", _raw([5, -6], "<i4"), "candidates.item[1]"),
    (
      "candidates",
      "item",
      _raw([DATA.num_items, 6], "<i4"),
      "candidates.item[0]",
    ),
    (
      "candidates",
      "category",
      _raw([1, DATA.num_categories], "<i4"),
      "candidates.category[1]",
    ),
    ("candidates", "price", _raw([1.0, np.nan], "<f4"), "candidates.price[1]"),
    ("candidates", "price", _raw([np.inf, 1], "<f4"), "candidates.price[0]"),
    ("candidates", "price", _raw([1.0, -2], "<f4"), "candidates.price[1]"),
    ("history", "ts", _raw([10, 20, -1, 30], "<i8"), "history.ts[2]"),
    ("history", "ts", _raw([10, 20, 2**33, 30], "<i8"), "history.ts[2]"),
    ("history", "ts", _raw([10, 20, 15, 30], "<i8"), "history.ts[2]"),  # order
    ("history", "action", _raw([0, 1, 9, 0], "<i1"), "history.action[2]"),
    ("history", "action", _raw([0, -1, 2, 0], "<i1"), "history.action[1]"),
  ],
)
def test_bad_binary_column_is_named(part, name, value, field, b64):
  r = binary(request())
  if value is None:
    del r[part][name]
  else:
    r[part][name] = value
  with pytest.raises(RequestError) as e:
    parse_request(r, DATA, DATA.num_dense, "requests[0]")
  assert e.value.field == f"requests[0].{field}", str(e.value)
  assert str(e.value).startswith(f"requests[0].{field}: ")


def test_binary_empty_candidates_and_history():
  r = binary(request())
  r["candidates"] = {k: "" for k in CANDIDATES}
  with pytest.raises(RequestError) as e:
    parse_request(r, DATA, DATA.num_dense)
  assert e.value.field == "request.candidates.item"
  r = binary(request())
  r["history"] = {k: "" for k in HISTORY}  # an empty history is allowed
  assert parse_request(r, DATA, DATA.num_dense)["hist_ts"].size == 0


def test_encode_column_refuses_what_its_dtype_cannot_hold():
  assert encode_column([1, 2], "item") == _raw([1, 2], BINARY["item"])
  assert encode_column([21.7], "price") == _raw([21.7], "<f4")
  for vals, name in (([2**31], "item"), ([1.5], "ts"), ([128], "action")):
    with pytest.raises(ValueError, match=name):
      encode_column(vals, name)


@pytest.fixture(params=["orjson", "json"])
def codec(request, monkeypatch):
  """Both codecs of `http`: orjson when installed, and Python's json."""
  if request.param == "orjson":
    pytest.importorskip("orjson")
  else:
    monkeypatch.setattr(http, "orjson", None)
  return request.param


def test_decode_and_encode_agree_across_codecs(codec):
  body = {"requests": [request()], "deadline_ms": 250}
  raw = json.dumps(body).encode()
  assert http.decode_json(raw) == body
  parsed, deadline = http.parse_body(
    http.decode_json(raw), DATA, DATA.num_dense, 1000.0
  )
  assert deadline == 0.25 and parsed[0]["cand_item"].tolist() == [5, 6]
  probs = [np.array([[0.25, 0.5], [1 / 3, 0.75]], np.float32)]
  out = json.loads(http.encode_scores(probs, ("ctr", "cvr"), 7))
  assert out["step"] == 7
  np.testing.assert_allclose(out["scores"][0]["ctr"], probs[0][:, 0])
  np.testing.assert_allclose(out["scores"][0]["cvr"], probs[0][:, 1])


def test_nan_and_huge_numbers_reach_validation(codec):
  """JSON that only Python's parser reads (NaN, ints past 64 bits) is
  answered by validation naming the field, not refused as a whole body."""
  r = request()
  r["candidates"]["price"][1] = float("nan")
  r["history"]["ts"][0] = 10**30
  body = http.decode_json(json.dumps({"requests": [r]}).encode())
  with pytest.raises(RequestError) as e:
    http.parse_body(body, DATA, DATA.num_dense, 1000.0)
  assert e.value.field == "requests[0].candidates.price[1]"
  with pytest.raises(http.BadJSON):
    http.decode_json(b"{not json")
  with pytest.raises(http.BadJSON):
    http.decode_json(b"\xff\xfe")
