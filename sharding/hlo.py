"""The collectives of a compiled program, read from its HLO text.

Placement claims are claims about communication ("the gradient all-reduce
is the only traffic that crosses `cluster`"), so tests and the
communication model check them where they become true: in the optimized HLO
that XLA will run. For every collective this gives its kind, its result
bytes per device, its device groups (all three spellings XLA prints:
explicit lists, iota `[g,n]<=[dims]T(perm)`, and `mesh[...] {axes}`), how
many times the program reaches it (XLA shares one computation between
identical call sites, e.g. the lookup loops of two same-shaped tables), and
whether it sits in a while-loop body (run a data-dependent number of times
per reach, e.g. the overflow passes of an embedding lookup).

`tiers(c, mesh_shape)` names the mesh axes a collective spans: the axes along
which the devices of one group differ. Device numbers in the groups are
positions in the mesh's flattened device array (global device ids in the
SPMD program's device assignment).
"""

import dataclasses
import math
import re

import numpy as np

KINDS = (
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)
DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}

_OP = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s("
  + "|".join(KINDS)
  + r")(-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  name: str
  kind: str
  bytes: int  # result bytes per device (all operands of a tuple op)
  groups: tuple[tuple[int, ...], ...]  # () = every device, one group
  in_loop: bool  # inside a while body
  count: int = 1  # call sites reaching it (per loop iteration if in_loop)

  @property
  def group_size(self) -> int:
    return max((len(g) for g in self.groups), default=0)


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  comps = _computations(hlo_text)
  loop_bodies = set()
  for lines in comps.values():
    for line in lines:
      if " while(" in line:
        loop_bodies.update(_BODY.findall(line))
  loop_comps = _reachable(comps, loop_bodies)
  counts = _call_counts(comps)
  out = []
  for comp, lines in comps.items():
    for line in lines:
      m = _OP.match(line)
      if not m:
        continue
      name, type_str, kind, start = m.groups()
      nbytes = _bytes(type_str)
      if start:  # async start: (operands, results, ...): count the results
        nbytes //= 2
      groups = _groups(line, kind, num_devices)
      out.append(
        Collective(
          name, kind, nbytes, groups, comp in loop_comps, counts.get(comp, 1)
        )
      )
  return out


def tiers(c: Collective, mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """Mesh axes (in mesh order) along which members of a group differ."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  n = math.prod(sizes)
  groups = c.groups or (tuple(range(n)),)
  span = set()
  for g in groups:
    coords = np.array(np.unravel_index(np.array(g), sizes)).T  # [len, axes]
    for i, a in enumerate(names):
      if len(set(coords[:, i])) > 1:
        span.add(a)
  return tuple(a for a in names if a in span)


def wire_bytes(c: Collective) -> float:
  """Bytes one device sends for `c` with ring/pairwise algorithms."""
  n = c.group_size
  if n <= 1:
    return 0.0
  f = (n - 1) / n
  if c.kind == "all-reduce":
    return 2 * f * c.bytes
  if c.kind == "reduce-scatter":
    return (n - 1) * c.bytes  # its input is n times its result
  if c.kind == "collective-permute":
    return float(c.bytes)
  return f * c.bytes  # all-gather, all-to-all


def _computations(text: str) -> dict[str, list[str]]:
  comps, cur = {}, None
  for line in text.splitlines():
    if cur is None:
      m = _HEADER.match(line)
      if m and not line.startswith(" "):
        cur = m.group(1)
        comps[cur] = []
      continue
    if line.startswith("}"):
      cur = None
      continue
    comps[cur].append(line)
  return comps


_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")


def _callees(line: str) -> list[str]:
  out = _CALLS.findall(line)
  for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
    out += [g.strip().lstrip("%") for g in group.split(",")]
  return out


def _call_counts(comps) -> dict[str, int]:
  """How many call sites reach each computation from the entry (the last
  computation XLA prints), through calls, loops and branches."""
  order = list(comps)
  if not order:
    return {}
  counts = {order[-1]: 1}
  # Callees are printed before their callers: walk callers first.
  for comp in reversed(order):
    n = counts.get(comp, 0)
    if not n:
      continue
    for line in comps[comp]:
      for callee in _callees(line):
        counts[callee] = counts.get(callee, 0) + n
  return counts


def _reachable(comps, roots) -> set[str]:
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      todo += re.findall(
        r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line
      )
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        todo += [g.strip().lstrip("%") for g in group.split(",")]
  return seen


def _bytes(type_str: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(type_str):
    if dtype not in DTYPE_BYTES:
      continue
    shape = [int(d) for d in dims.split(",") if d]
    total += DTYPE_BYTES[dtype] * math.prod(shape)
  return total


def _groups(line: str, kind: str, n: int):
  if kind == "collective-permute":
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(1) + "}") if m else []
    return tuple((int(a), int(b)) if a != b else (int(a),) for a, b in pairs)
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    over = re.findall(r"'([^']+)'", m.group(2))
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    keep = [i for i, a in enumerate(names) if a not in over]
    moved = [names.index(a) for a in over]
    g = ids.transpose(keep + moved).reshape(
      -1, math.prod(sizes[i] for i in moved) if moved else 1
    )
    return tuple(tuple(int(x) for x in row) for row in g)
  m = re.search(
    r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line
  )
  if m:
    g, size = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return tuple(tuple(int(x) for x in row) for row in ids.reshape(g, size))
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if m:
    groups = re.findall(r"\{([\d,]*)\}", m.group(1))
    return tuple(
      tuple(int(x) for x in grp.split(",") if x) for grp in groups if grp
    )
  if "replica_groups" not in line or "replica_groups={}" in line:
    return (tuple(range(n)),)
  raise ValueError(f"cannot read the replica groups of: {line.strip()[:200]}")
