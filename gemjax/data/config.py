"""`DataConfig`: everything that decides which batches the loader yields.

One frozen, typed dataclass (nested as `Config.data` by `gemjax.config`).
Its defaults describe the seeds' 2K traffic (OneTrans V3.1, O1): user
histories whose length is log-normal (median 1,100 events, sigma 0.6) capped
at 2,048, a few users with no history at all, four action types with a
realistic skew, Zipf-popular items and categories, timestamps and prices, and
several candidate items per request labelled for CTR and conversion.

Static shapes of one data-parallel shard's batch (legend of STYLE.md):
  b = `requests_per_shard`   requests (rows of `offsets`, minus one)
  t = `token_capacity`       history events in the flat token buffer
  c = `cand_capacity`        candidate rows
  f = `num_dense`            dense request features

Sizing rule: `token_capacity` ~ b * mean history length * (1 + a few %);
`expected_tokens_per_request()` gives the mean of the synthetic traffic. A
request that does not fit goes to the next batch (counted), so a tight buffer
costs a little reordering, never data.

Labels: `labels[:, 0]` is CTR (the candidate was clicked), `labels[:, 1]` is
conversion *over all candidates* (clicked AND then ordered; ESMM's "CTCVR"),
so both heads train with plain BCE on every candidate row. The synthetic
hidden model draws it as click ~ Bernoulli(p_ctr), then, only if clicked,
order ~ Bernoulli(p_cvr | click); the true conversion probability of a
candidate is p_ctr * p_cvr|click.

Vocabulary sizes (`vocab_sizes()`): every int feature column of `seq` and
`cand` and the `user_id` table. History and candidate columns of the same name
(`item_id`, `category_id`, `price`) index the same table, O9.
"""

import dataclasses
import math

# Action types in id order. Quota priorities are configured separately.
ACTIONS: tuple[str, ...] = ("impression", "click", "cart", "order")
ACTION_ID: dict[str, int] = {a: i for i, a in enumerate(ACTIONS)}

SEQ_FEATURES = ("item_id", "category_id", "action", "ts_delta", "ts_to_req")
SEQ_FEATURES = SEQ_FEATURES + ("price",)
CAND_FEATURES = ("item_id", "category_id", "price")
TASKS = ("ctr", "cvr")
SOURCES = ("synthetic", "movielens", "taobao", "recbole", "events", "parquet")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # Source: "synthetic" (generated event logs), or a file at `path` read by
  # gemjax.data.events (needs pyarrow, the `data` extra): "movielens"
  # (ratings.dat / ratings.csv), "taobao" (UserBehavior.csv), "recbole" (a
  # RecBole atomic `.inter` file, e.g. ml-100k from `make data`), "events"
  # (gemjax's own event CSV) or "parquet" (the same schema in Parquet).
  source: str = "synthetic"
  path: str = ""
  seed: int = 0

  # Tables. Ids are rows: item ids and category ids are Zipf-popular (row 0 is
  # the most popular); real logs hash their raw ids into these tables.
  num_items: int = 200_000
  num_categories: int = 2_000
  num_users: int = 100_000
  num_dense: int = 8

  # History (sequence) building, O1-O4.
  max_seq_len: int = 2048
  # Action quota O2, in priority order: (action, cap). Unused quota of a type
  # passes to the next type in this order, except into the types named in
  # `no_backfill`, which never exceed their own cap (impressions: hard 100).
  quota: tuple[tuple[str, int], ...] = (
    ("order", 512),
    ("cart", 512),
    ("click", 924),
    ("impression", 100),
  )
  no_backfill: tuple[str, ...] = ("impression",)
  # Dedup rule: "none"; "consecutive" (drop an event equal in item and action
  # to the previous event of the same history); "item_action" (keep only the
  # newest event per (item, action)); "item" (keep only the newest per item).
  dedup: str = "consecutive"
  # Bad input: "error" (raise, naming file and line) or "skip" (count it).
  on_bad_input: str = "error"
  # An event earlier than its user's previous one in file order: "sort"
  # (reorder, counted as `reordered`), "error" or "skip" (counted).
  time_order: str = "sort"

  # Real logs (gemjax.data.events): rating -> action (min rating, action),
  # below every threshold an impression; Taobao behaviour -> action.
  rating_actions: tuple[tuple[float, str], ...] = (
    (5.0, "order"),
    (4.0, "cart"),
    (3.0, "click"),
  )
  taobao_actions: tuple[tuple[str, str], ...] = (
    ("pv", "click"),
    ("fav", "cart"),
    ("cart", "cart"),
    ("buy", "order"),
  )
  # Bytes per CSV block read at a time (Parquet: read_chunk_bytes / 64 rows);
  # reading memory is a small multiple of it.
  read_chunk_bytes: int = 8 << 20
  # Requests from a log (gemjax.data.protocol): a user's events are cut
  # into requests at gaps longer than `session_gap_s` and after every
  # `max_cands - neg_per_request` distinct items; each request also gets
  # `neg_per_request` sampled items the user never touched (`negatives`:
  # "popularity" or "uniform"). `protocol` picks the held-out set:
  # "temporal" (requests at or after `split_time`, or after the time that
  # leaves `eval_frac` of the events, for the same users), "leave_one_out"
  # (each user's last event among `loo_negatives` sampled items; HR@K and
  # NDCG@K) or "user" (users hashed into `eval_frac`: cold start).
  protocol: str = "temporal"
  split_time: int = 0
  eval_frac: float = 0.1
  session_gap_s: int = 1800
  neg_per_request: int = 2
  negatives: str = "popularity"
  loo_negatives: int = 100

  # Context features O3: log-bucketed ids (see gemjax.data.features).
  # Bucket k >= 1 holds x in [base^(k-1) - 1, base^k - 1); 0 means missing.
  ts_bucket_base: float = 2.0  # seconds: [0,1), [1,3), [3,7), ... ~34 years
  ts_buckets: int = 32
  price_bucket_base: float = 1.5  # price units: [0,.5), [.5,1.25), ...
  price_buckets: int = 48

  # Synthetic traffic.
  len_median: float = 1100.0
  len_sigma: float = 0.6
  zero_len_frac: float = 0.01
  min_cands: int = 4
  max_cands: int = 12
  item_zipf: float = 1.1
  category_zipf: float = 1.1

  # Batches of one data-parallel shard (static shapes b, t, c).
  requests_per_shard: int = 32
  token_capacity: int = 40_960
  cand_capacity: int = 384

  # Batching: "bbs" (Base Batch Shuffling, G10) or "random" (stream order).
  batching: str = "bbs"
  bbs_minibatch: int = 4  # the seed's 128 at 1,024 requests per rank
  bbs_pool_batches: int = 8  # full batches pooled, sorted and paired at once
  # What BBS balances: "tokens" (the seed: sum of lengths), "attn" (sum of
  # len^2) or "cost" (FLOPs of one OneTrans layer, a*len + b*len^2).
  bbs_weight: str = "cost"
  prefetch: int = 2  # batches produced ahead by the background thread
  # Processes building synthetic blocks ahead (0: in the loader's thread).
  # ~1,500 requests/s per core at 2K; use a few on a GPU host.
  workers: int = 0

  eval_requests: int = 4096

  def __post_init__(self):
    c = checker(self, "data")
    for name, allowed in (
      ("source", SOURCES),
      ("protocol", ("temporal", "leave_one_out", "user")),
      ("negatives", ("popularity", "uniform")),
      ("dedup", ("none", "consecutive", "item_action", "item")),
      ("on_bad_input", ("error", "skip")),
      ("time_order", ("sort", "error", "skip")),
      ("batching", ("bbs", "random")),
      ("bbs_weight", ("tokens", "attn", "cost")),
    ):
      c(name, getattr(self, name) in allowed, f"one of {allowed}")
    for name in ("rating_actions", "taobao_actions"):
      c(
        name,
        all(a in ACTIONS for _, a in getattr(self, name)),
        f"pairs naming actions of {ACTIONS}",
      )
    c(
      "path",
      (self.source == "synthetic") == (not self.path),
      (f"empty with data.source={self.source!r}" if self.path
       else f"a file with data.source={self.source!r}")
      + f" (the file sources are {SOURCES[1:]})",
    )  # fmt: skip
    names = [a for a, _ in self.quota]
    c(
      "quota",
      len(names) == len(set(names)) and set(names) <= set(ACTIONS),
      f"distinct actions of {ACTIONS}",
    )
    c(
      "quota",
      all(cap >= 0 for _, cap in self.quota),
      "(action, cap) pairs with caps >= 0",
    )
    c(
      "no_backfill",
      set(self.no_backfill) <= set(ACTIONS),
      f"actions of {ACTIONS}",
    )
    for name in (
      "num_items",
      "num_categories",
      "num_users",
      "max_seq_len",
      "requests_per_shard",
      "bbs_minibatch",
      "bbs_pool_batches",
      "read_chunk_bytes",
    ):
      c(name, getattr(self, name) >= 1, ">= 1")
    for name in (
      "num_dense",
      "session_gap_s",
      "eval_requests",
      "workers",
      "prefetch",
    ):
      c(name, getattr(self, name) >= 0, ">= 0")
    c(
      "num_categories",
      self.num_categories <= self.num_items,
      f"<= num_items={self.num_items}",
    )
    c(
      "neg_per_request",
      0 <= self.neg_per_request < self.max_cands,
      f"in [0, max_cands={self.max_cands})",
    )
    c("eval_frac", 0 < self.eval_frac < 1, "in (0, 1)")
    c("loo_negatives", self.loo_negatives >= 1, ">= 1")
    c("split_time", self.split_time >= 0, ">= 0 (0: from eval_frac)")
    # 0 = derived from the log (`loader.resolve_capacities`), real logs only.
    auto = self.source != "synthetic"
    c(
      "token_capacity",
      self.token_capacity >= self.max_seq_len
      or (auto and self.token_capacity == 0),
      f">= max_seq_len={self.max_seq_len} (a full-length history must fit)"
      + (", or 0 to derive it from the log" if auto else ""),
    )
    c("min_cands", self.min_cands >= 1, ">= 1")
    c(
      "max_cands",
      self.max_cands >= self.min_cands,
      f">= min_cands={self.min_cands}",
    )
    c(
      "cand_capacity",
      self.cand_capacity >= self.max_request_cands
      or (auto and self.cand_capacity == 0),
      f">= {self.max_request_cands}, the most candidates of one request"
      + (", or 0 to derive it from the log" if auto else ""),
    )
    c(
      "requests_per_shard",
      self.requests_per_shard % self.bbs_minibatch == 0,
      f"a multiple of bbs_minibatch={self.bbs_minibatch}",
    )
    for name in ("ts_buckets", "price_buckets"):
      c(name, getattr(self, name) >= 3, ">= 3")
    for name in ("ts_bucket_base", "price_bucket_base"):
      c(name, getattr(self, name) > 1, "> 1")
    c("zero_len_frac", 0 <= self.zero_len_frac < 1, "in [0, 1)")
    c("len_median", self.len_median > 0, "> 0")
    c("len_sigma", self.len_sigma >= 0, ">= 0")
    for name in ("item_zipf", "category_zipf"):
      c(name, getattr(self, name) > 0, "> 0")

  @property
  def max_request_cands(self) -> int:
    """The most candidates one request can have (train or eval)."""
    if self.source != "synthetic" and self.protocol == "leave_one_out":
      return max(self.max_cands, self.loo_negatives + 1)
    return self.max_cands

  def vocab_sizes(self) -> dict[str, int]:
    """Rows of every int feature table (seq, cand and `user_id`)."""
    return vocab_sizes(self)

  def expected_tokens_per_request(self) -> float:
    """Mean built history length of the synthetic traffic (for sizing t).

    E[min(X, m)] of a log-normal X with median M and sigma s:
      e^(mu + s^2/2) Phi((ln m - mu - s^2)/s) + m (1 - Phi((ln m - mu)/s)),
    times the fraction of users that have a history at all.
    """
    mu, s, m = math.log(self.len_median), self.len_sigma, self.max_seq_len
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    below = math.exp(mu + s * s / 2) * phi((math.log(m) - mu - s * s) / s)
    above = m * (1 - phi((math.log(m) - mu) / s))
    return (1 - self.zero_len_frac) * (below + above)


def vocab_sizes(cfg: DataConfig) -> dict[str, int]:
  return {
    "item_id": cfg.num_items,
    "category_id": cfg.num_categories,
    "action": len(ACTIONS),
    "ts_delta": cfg.ts_buckets,
    "ts_to_req": cfg.ts_buckets,
    "price": cfg.price_buckets,
    "user_id": cfg.num_users,
  }


def checker(cfg, section: str):
  """`check(name, ok, allowed)` for the fields of `cfg`: when not `ok`, a
  one-line ValueError naming `section.name`, its value and what is allowed
  (the same words a `--set section.name=...` override would use)."""

  def check(name: str, ok: bool, allowed) -> None:
    if not ok:
      value = getattr(cfg, name)
      raise ValueError(f"{section}.{name}={value!r}: must be {allowed}")

  return check
