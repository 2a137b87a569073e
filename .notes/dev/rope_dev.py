"""Dev: XLA RoPE at in-sequence positions (trig per row) vs a block-position
table (rope_in_blocks), alone and inside block attention at block 128."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from benchmarks import common
from pallas_kernels.block_attention import op
from pallas_kernels.block_attention.reference import (
  block_attention_reference, positions, rope_reference, prepare)
from pallas_kernels.jagged_attention.op import jagged_attention_mosaic

B, LMAX, N, KH, D, THETA = 32, 2048, 8, 2, 128, 10_000.0
out = {}
rng = np.random.default_rng(0)
for mix in ("lognormal", "all2048"):
  lens = (common.lognormal_lengths(rng, B, LMAX) if mix == "lognormal"
          else np.full(B, LMAX, np.int32))
  off = common.offsets(lens)
  t = -(-(int(off[-1]) + 64) // 64) * 64
  off_j = jnp.asarray(off)
  sets = []
  for r in range(4):
    ks = jax.random.split(jax.random.key(r), 4)
    sets.append((jax.random.normal(ks[0], (t, N, D), jnp.bfloat16),
                 jax.random.normal(ks[1], (t, KH, D), jnp.bfloat16),
                 jax.random.normal(ks[2], (t, KH, D), jnp.bfloat16),
                 jax.random.normal(ks[3], (t, N, D), jnp.bfloat16)))
  for block in (128, 64):
    def rope_old(q, k, v, do):
      pos = positions(off_j, t)
      return rope_reference(q, pos, THETA), rope_reference(k, pos, THETA)
    def rope_new(q, k, v, do):
      return (op.rope_in_blocks(q, off_j, block, THETA),
              op.rope_in_blocks(k, off_j, block, THETA))
    def old(q, k, v):
      if block == 128:
        q2, k2, o2, ml = prepare(q, k, v, off_j, THETA, LMAX, "x")
        blocks = op.block_offsets(o2, 128, t, ml)
        return jagged_attention_mosaic(q2, k2, v, blocks, max_len_q=128,
          max_len_kv=128, block_sizes=op.jagged_block_sizes(D))
      return None
    def new(q, k, v):
      return op.block_attention_mosaic(q, k, v, off_j, block=block,
                                       rope=THETA, max_len=LMAX)
    def ref(q, k, v):
      return block_attention_reference(q.astype(jnp.float32),
        k.astype(jnp.float32), v.astype(jnp.float32), off_j, block=block,
        rope=THETA, max_len=LMAX)
    fb = common.fwd_bwd
    q, k, v, do = sets[0]
    got = jax.jit(fb(new))(q, k, v, do)
    want = jax.jit(fb(ref))(q, k, v, do.astype(jnp.float32))
    n = int(off[-1])
    errs = {nm: common.rel_err(g[:n], w[:n]) for nm, g, w in
            zip(("o", "dq", "dk", "dv"), got, want)}
    print(mix, block, "errs", errs, flush=True)
    runs = {"rope_old": (rope_old, sets), "rope_new": (rope_new, sets),
            "new_fwd": (lambda q, k, v, do: new(q, k, v), sets),
            "new_fwdbwd": (fb(new), sets)}
    if block == 128:
      runs["old_fwd"] = (lambda q, k, v, do: old(q, k, v), sets)
      runs["old_fwdbwd"] = (fb(old), sets)
    res = common.time_sets_interleaved(runs)
    res = {k2: v2 * 1e3 for k2, v2 in res.items()}
    print(mix, block, {k2: round(v2, 4) for k2, v2 in res.items()}, flush=True)
    out[f"{mix} {block}"] = {"ms": res, "errs": errs}
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "rope.json"), "w"), indent=1)
