"""Sharded embedding lookups (G7): three generations, one API.

Legend: `v` table rows, `e` row width, `S` data shards (the stacked batch's
leading axis, split over devices), `m` ids one device looks up, `n` devices
in the exchange group, `B = v / n` rows one exchange index serves, `k`
bucket capacity.

A table `[v, e]` is split by rows at rest (`table_rows` rule). A lookup runs
in `shard_map`; on every device:
1. dedup: the device's ids (all columns that read this table, O9: history
   and candidate item ids together) are sorted and made unique,
   `jnp.unique(size=m)`; a hot id is sent once per device, not once per use;
2. bucket: unique ids go to the bucket of their owner, `id // B`; buckets
   have a static capacity `k = ceil(capacity_factor * m / n)`, or `k = m`
   (room for every id) when that is at most twice as large (`n <=
   2 * capacity_factor`, e.g. 2 devices): one pass is then always enough,
   and the lookup has no loop (on the GPU, a loop's trip count is a host
   round trip that stalls the launch queue, a sync per lookup);
3. exchange: an all-to-all of `[n, k]` ids over the exchange group, a local
   gather of the requested rows, an all-to-all of `[n, k, e]` rows back;
4. overflow: a bucket with more than `k` ids is served by further passes
   (pass `p` carries bucket slots `p*k ... p*k+k-1`); the pass count is the
   group's maximum (`pmax`), so all members run the same collectives. No
   id is ever dropped; a skewed batch costs extra passes, not accuracy;
5. un-dedup: each id reads its unique id's row.

The backward pass (`custom_vjp`) runs the same plan in reverse: row
gradients are summed per unique id, sent to the owners with the same
buckets and passes, and scatter-added into the owner's rows. The table
gradient is dense `[v/n_rows, e]` per device, what row-wise Adagrad expects.

Generations (see `sharding.rules`):
- gen 1, rows over every device; the exchange spans the whole mesh, so its
  all-to-all crosses the thin `cluster` links;
- gen 2, each group (`cluster` index) holds a full copy split over
  (`zone`, `node`); the exchange stays inside the group; gradients are
  all-reduced over `cluster` (the groups are data-parallel);
- gen 3, stored as gen 2, but the exchange group is `zone` only (GPU `j`
  of every host): an id goes to its owner *host*, whose block of rows is
  split over its `node` GPUs. There the requests one GPU received are
  all-gathered over `node` (NVLink), every GPU of the host looks up the ids
  in its own slice (zero rows elsewhere), and a reduce-scatter over `node`
  returns each GPU the rows of its requests. The backward all-gathers the
  row gradients over `node` and each GPU adds the ones of its slice. The
  all-to-all has `node` times fewer peers with `node` times larger
  messages (same bytes per GPU), and the extra traffic, about `node - 1`
  times the exchanged rows, runs on NVLink.

A table whose rows the tiers do not divide is replicated (the rule table's
fallback) and looked up locally with `jnp.take`.

Pooled lookups (`lookup_pooled`) sum or average each request's rows after
the exchange (requester-side pooling: dedup already sends each row once).
Ids outside `[0, v)` read a zero row on every path.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from sharding import rules

DEFAULT_CAPACITY_FACTOR = 1.0


@dataclasses.dataclass(frozen=True)
class TableLayout:
  """Where one table's rows live and which tiers a lookup talks over."""

  rows: tuple[str, ...]  # mesh axes splitting rows at rest (major first)
  exchange: tuple[str, ...]  # all-to-all group: a major prefix of `rows`
  gather: tuple[str, ...]  # rows minus exchange: requests gathered over it
  copies: tuple[str, ...]  # tiers holding full copies: gradients summed

  @property
  def sharded(self) -> bool:
    return bool(self.rows)


def table_layout(mesh: Mesh, strategy: str, num_rows: int) -> TableLayout:
  spec = rules.logical_to_spec(
    ("table_rows", "table_dim"), (num_rows, 1), mesh, strategy
  )
  rows = _axes(spec[0])
  if not rows:
    return TableLayout((), (), (), ())
  exchange = tuple(
    a for a in rules.rule(strategy, "table_exchange") if a in rows
  )
  gather = rows[len(exchange) :]
  if rows[: len(exchange)] != exchange:
    raise ValueError(
      f"strategy {strategy!r}: exchange axes {exchange} must be the major "
      f"part of the row axes {rows}"
    )
  copies = tuple(
    a for a in mesh.axis_names if a not in rows and mesh.shape[a] > 1
  )
  return TableLayout(rows, exchange, gather, copies)


@dataclasses.dataclass(frozen=True)
class _Plan:
  mesh: Mesh
  layout: TableLayout
  batch: tuple[str, ...]  # mesh axes of the ids' leading (shard) axis
  num_rows: int
  capacity_factor: float

  def size(self, axes) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)


def lookup(
  table_ve,
  ids,
  *,
  mesh: Mesh,
  strategy: str,
  capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
):
  """Rows of `table_ve` for every id array in `ids`.

  `ids` is a sequence of int arrays `[S, ...]` whose leading axis is split by
  the strategy's batch rule; all of them are served by one exchange.
  Returns a list of `[S, ..., e]` arrays (the table's dtype).
  """
  ids = tuple(jnp.asarray(i, jnp.int32) for i in ids)
  v = table_ve.shape[0]
  layout = table_layout(mesh, strategy, v)
  if not layout.sharded:
    return [_take(table_ve, i) for i in ids]
  plan = _Plan(
    mesh, layout, rules.batch_axes(mesh, strategy), v, capacity_factor
  )
  n_batch = plan.size(plan.batch)
  for i in ids:
    if i.ndim < 1 or i.shape[0] % n_batch:
      raise ValueError(
        f"ids of shape {i.shape}: leading axis must split over {n_batch} "
        f"devices ({plan.batch})"
      )
  return list(_sharded_lookup(plan, table_ve, ids))


def lookup_pooled(
  table_ve,
  ids_st,
  offsets_sb,
  *,
  mesh: Mesh,
  strategy: str,
  combiner: str = "sum",
  capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
):
  """Pooled (bag) lookup: `[S, b, e]`, request `i` of shard `s` pools the
  rows of `ids_st[s, offsets_sb[s, i]:offsets_sb[s, i+1]]` ("sum" or
  "mean"; an empty request gives zeros)."""
  if combiner not in ("sum", "mean"):
    raise ValueError(f"combiner must be 'sum' or 'mean', got {combiner!r}")
  (rows_ste,) = lookup(
    table_ve,
    [ids_st],
    mesh=mesh,
    strategy=strategy,
    capacity_factor=capacity_factor,
  )
  return jax.vmap(functools.partial(pool, combiner=combiner))(
    rows_ste, offsets_sb
  )


def plan_passes(
  ids,
  num_rows: int,
  *,
  mesh: Mesh,
  strategy: str,
  capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> int:
  """Exchange passes one lookup of `ids` takes (host numpy, no devices):
  the most any device needs. `ids` as for `lookup`; 0 = a local table."""
  import numpy as np

  layout = table_layout(mesh, strategy, num_rows)
  if not layout.sharded:
    return 0
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  n = size(layout.exchange)
  owner_rows = num_rows // n
  devices = size(rules.batch_axes(mesh, strategy))
  per = [np.asarray(i).reshape(devices, -1) for i in ids]  # [dev, ...]
  passes = 0
  for d in range(devices):
    flat = np.concatenate([p[d] for p in per])
    m = flat.size
    k = _capacity(m, n, capacity_factor)
    uniq = np.unique(flat[(flat >= 0) & (flat < num_rows)])
    counts = np.bincount(uniq // owner_rows, minlength=n)
    passes = max(passes, -(-int(counts.max(initial=0)) // k))
  return passes


def pool(rows_te, offsets_b, combiner: str = "sum"):
  """`[t, e]` packed rows -> `[b, e]` per-request sums (or means)."""
  t, b = rows_te.shape[0], offsets_b.shape[0] - 1
  pos = jnp.arange(t)
  seg = jnp.searchsorted(offsets_b, pos, side="right") - 1
  seg = jnp.where(pos < offsets_b[-1], seg, b)  # the tail: dropped segment
  out = jax.ops.segment_sum(rows_te, seg, num_segments=b + 1)[:b]
  if combiner == "mean":
    n = jnp.maximum(offsets_b[1:] - offsets_b[:-1], 1)
    out = out / n[:, None].astype(out.dtype)
  return out


def _take(table_ve, ids):
  v = table_ve.shape[0]
  ok = (ids >= 0) & (ids < v)
  rows = jnp.take(table_ve, jnp.where(ok, ids, 0), axis=0)
  return jnp.where(ok[..., None], rows, 0).astype(table_ve.dtype)


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(axes) -> PartitionSpec:
  return PartitionSpec(axes or None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_lookup(plan, table_ve, ids):
  return _forward(plan, table_ve, ids)


def _sharded_lookup_fwd(plan, table_ve, ids):
  return _forward(plan, table_ve, ids), ids


def _sharded_lookup_bwd(plan, ids, g_rows):
  return _backward(plan, ids, tuple(g_rows)), None


_sharded_lookup.defvjp(_sharded_lookup_fwd, _sharded_lookup_bwd)


def _forward(plan, table_ve, ids):
  batch = _spec(plan.batch)

  def body(table_loc, *ids_loc):
    flat = jnp.concatenate([i.reshape(-1) for i in ids_loc])  # [m]
    sub = table_loc.shape[0]  # my rows; the exchange index owns g * sub
    g = plan.size(plan.layout.gather)
    ex = _Exchange(plan, flat, sub * g)
    out_u = jnp.zeros((ex.m, table_loc.shape[1]), table_loc.dtype)

    def one_pass(p, out_u):
      send, dest = ex.slots(p)
      recv = ex.all_to_all(send)  # [n*k] row ids (in my host's block)
      if g == 1:
        got = _take_rows(table_loc, recv, 0)
      else:  # gen 3: the host's requests, served by the slice owners
        reqs = jax.lax.all_gather(recv, plan.layout.gather)  # [g, n*k]
        got = _take_rows(table_loc, reqs, _index(plan) * sub)
        got = jax.lax.psum_scatter(got, plan.layout.gather)  # [n*k, e]
      back = ex.all_to_all(got)  # [n*k, e] the rows I asked for
      return out_u.at[dest].set(back, mode="drop")

    out_u = ex.loop(one_pass, out_u)
    rows = jnp.where(ex.valid[:, None], out_u[ex.inverse], 0)
    return tuple(_split(rows, ids_loc))

  out = jax.shard_map(
    body,
    mesh=plan.mesh,
    in_specs=(_spec(plan.layout.rows), *([batch] * len(ids))),
    out_specs=tuple([batch] * len(ids)),
    check_vma=False,
  )(table_ve, *ids)
  return out


def _backward(plan, ids, g_rows):
  batch = _spec(plan.batch)
  g = plan.size(plan.layout.gather)
  sub = plan.num_rows // plan.size(plan.layout.rows)  # rows per device
  e = g_rows[0].shape[-1]

  def body(*args):
    ids_loc, g_loc = args[: len(ids)], args[len(ids) :]
    flat = jnp.concatenate([i.reshape(-1) for i in ids_loc])
    g_flat = jnp.concatenate([x.reshape(-1, e) for x in g_loc])  # [m, e]
    ex = _Exchange(plan, flat, sub * g)
    g_flat = jnp.where(ex.valid[:, None], g_flat, 0).astype(jnp.float32)
    g_u = jax.ops.segment_sum(g_flat, ex.inverse, num_segments=ex.m)

    def one_pass(p, grad_loc):
      send, _ = ex.slots(p)
      recv = ex.all_to_all(send)  # [n*k] row ids sent to my host
      recv_g = ex.all_to_all(ex.take_slots(g_u, p))  # [n*k, e]
      if g > 1:  # gen 3: every GPU of the host sees the host's gradients
        recv = jax.lax.all_gather(recv, plan.layout.gather, tiled=True)
        recv_g = jax.lax.all_gather(recv_g, plan.layout.gather, tiled=True)
        recv = recv - _index(plan) * sub
      where = jnp.where((recv >= 0) & (recv < sub), recv, sub)
      return grad_loc.at[where].add(recv_g, mode="drop")

    grad = ex.loop(one_pass, jnp.zeros((sub, e), jnp.float32))
    if plan.layout.copies:  # gen 2/3: the groups are data-parallel
      grad = jax.lax.psum(grad, plan.layout.copies)
    return grad

  grad = jax.shard_map(
    body,
    mesh=plan.mesh,
    in_specs=tuple([batch] * (2 * len(ids))),
    out_specs=_spec(plan.layout.rows),
    check_vma=False,
  )(*ids, *g_rows)
  assert grad.shape == (plan.num_rows, e), grad.shape
  return grad.astype(g_rows[0].dtype)


def _take_rows(table_loc, ids, first):
  """Rows `ids - first` of my slice, zero for ids outside it (or -1)."""
  local = ids - first
  ok = (ids >= 0) & (local >= 0) & (local < table_loc.shape[0])
  got = jnp.take(table_loc, jnp.where(ok, local, 0), axis=0)
  return jnp.where(ok[..., None], got, 0)


def _index(plan) -> jax.Array:
  """My position along the gather tiers (major first), as in the rows."""
  i = 0
  for a in plan.layout.gather:
    i = i * plan.mesh.shape[a] + jax.lax.axis_index(a)
  return i


class _Exchange:
  """One device's bucket plan: dedup, owners, slots per pass (see module)."""

  def __init__(self, plan: _Plan, flat, block_rows: int):
    self.axes = plan.layout.exchange
    self.n = n = plan.size(self.axes)
    self.m = m = flat.shape[0]
    self.k = k = _capacity(m, n, plan.capacity_factor)
    v = plan.num_rows
    self.valid = (flat >= 0) & (flat < v)
    key = jnp.where(self.valid, flat, v)  # invalid ids sort last
    uniq, inverse = jnp.unique(key, size=m, fill_value=v, return_inverse=True)
    self.inverse = inverse.reshape(-1)
    self.uniq = uniq
    owner = jnp.where(uniq < v, uniq // block_rows, n)  # [m], n = nobody
    self.counts = jnp.zeros((n,), jnp.int32).at[owner].add(1, mode="drop")
    self.start = jnp.cumsum(self.counts) - self.counts  # sorted: contiguous
    self.block_rows = block_rows
    self.passes = None  # k = m: one pass, always
    if k < m:
      local = (jnp.max(self.counts) + k - 1) // k
      # Every device that meets in a collective of a pass runs the same
      # passes: the exchange group and (gen 3) the host's gather group.
      group = self.axes + plan.layout.gather
      self.passes = jax.lax.pmax(local, group) if group else local

  def _pos(self, p):
    j = p * self.k + jnp.arange(self.k)  # [k] slot within a bucket
    ok = j[None, :] < self.counts[:, None]  # [n, k]
    pos = self.start[:, None] + j[None, :]
    return jnp.where(ok, pos, self.m), ok

  def slots(self, p):
    """Pass `p`: local row ids to ask each owner (-1 = empty) and where the
    answers go in the unique list (`m` = nowhere); both `[n*k]`."""
    pos, ok = self._pos(p)
    uniq = self.uniq[jnp.minimum(pos, self.m - 1)]
    owner = jnp.arange(self.n)[:, None]
    send = jnp.where(ok, uniq - owner * self.block_rows, -1)
    return send.reshape(-1), pos.reshape(-1)

  def take_slots(self, values_me, p):
    pos, ok = self._pos(p)
    got = values_me[jnp.minimum(pos, self.m - 1)]
    return jnp.where(ok[..., None], got, 0).reshape(-1, values_me.shape[-1])

  def all_to_all(self, x):
    if self.n == 1:
      return x
    return jax.lax.all_to_all(x, self.axes, 0, 0, tiled=True)

  def loop(self, one_pass, init):
    """Pass 0 in straight-line code, passes 1.. (overflow) in a loop.

    Peeling the first pass keeps the common case free of collectives
    inside a while loop. It also avoids a deadlock seen on XLA:CPU: a train
    step loaded from the persistent compilation cache, whose lookups ran
    their first pass inside the loop, hung with one device in a lookup's
    all-to-all and the other in a gradient all-reduce (every time, on 2
    devices); with the first pass peeled it ran, overflow passes included.
    """

    def cond(c):
      return c[0] < self.passes

    def step(c):
      return c[0] + 1, one_pass(c[0], c[1])

    first = one_pass(jnp.int32(0), init)
    if self.passes is None:
      return first
    return jax.lax.while_loop(cond, step, (jnp.int32(1), first))[1]


def _capacity(m: int, n: int, capacity_factor: float) -> int:
  """Bucket slots per owner and pass (see the module docstring, step 2)."""
  if n <= 2 * capacity_factor:
    return m
  return max(1, min(m, math.ceil(capacity_factor * m / n)))


def _split(rows_me, like):
  out, at = [], 0
  for x in like:
    n = x.size
    out.append(rows_me[at : at + n].reshape(*x.shape, rows_me.shape[-1]))
    at += n
  return out
