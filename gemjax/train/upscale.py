"""Depth up-scaling by copy-and-stack (O6, the seed's "Solar" recipe).

Stage one trains a shallow SeqFormer (e.g. 5 layers) with high throughput;
stage two starts from its checkpoint with the blocks copied and stacked into
a deeper one, e.g. layer map `0,1,2,3,2,3,4`: 5 -> 7 distinct blocks, new
block `i` starting as a copy of old block `map[i]`, then trains on. Unlike
the looped-layer control (`ModelConfig.layer_order` repeating a block, shared
weights), the copies are independent parameters from here on.

  python -m gemjax.train.upscale --from runs/shallow --to runs/deep \
      --config onetrans_v31 --layer-map 0,1,2,3,2,3,4

The new run starts at step 0 with a fresh optimizer state and the stage-two
config (`model.num_layers = len(layer_map)`), so its schedule warms up again.
"""

import argparse
import copy
import dataclasses
import sys

import jax
import numpy as np

from gemjax import config as config_lib
from gemjax.train import loop, runtime


def copy_and_stack(params: dict, layer_map) -> dict:
  """Params with `seqformer.blocks` rebuilt as `[old[i] for i in layer_map]`."""
  blocks = params["seqformer"]["blocks"]
  old = len(blocks)
  bad = [i for i in layer_map if not 0 <= i < old]
  if bad:
    raise ValueError(
      f"layer map {tuple(layer_map)} names blocks {bad}; the "
      f"checkpoint has {old} (0..{old - 1})"
    )
  out = copy.copy(params)
  out["seqformer"] = dict(params["seqformer"])
  out["seqformer"]["blocks"] = {
    new: jax.tree.map(np.array, blocks[i]) for new, i in enumerate(layer_map)
  }
  return out


def upscaled_start(src: loop.Trainer, dst: loop.Trainer, layer_map) -> None:
  """Write `dst`'s step-0 checkpoint: `src`'s latest parameters with their
  SeqFormer blocks copied and stacked by `layer_map` (O6), a fresh optimizer
  state and a fresh data position."""
  src_ckpt = src.checkpointer()
  step = src_ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {src.run_dir}")
  state, _ = src_ckpt.restore(step, src.abstract_state)
  src_ckpt.close()
  params = copy_and_stack(jax.device_get(state["params"]), layer_map)
  new = jax.device_put(
    loop.fresh_state(params, dst.tx, dst.cfg.train.seed), dst.state_shardings
  )
  out = dst.checkpointer()
  out.save(
    0,
    new,
    {"processes": runtime.gathered_by_process(dst.loader().state())},
    config_lib.to_dict(dst.cfg),
  )
  out.wait()
  out.close()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m gemjax.train.upscale", description=__doc__.split("\n")[0]
  )
  p.add_argument("--from", dest="src", required=True, help="run directory")
  p.add_argument("--to", dest="dst", required=True, help="new run directory")
  p.add_argument(
    "--config", required=True, help="a name in --configs-dir, or a .py file"
  )
  p.add_argument("--configs-dir", default="configs")
  p.add_argument("--layer-map", required=True, help="e.g. 0,1,2,3,2,3,4")
  p.add_argument("--set", dest="overrides", action="append", default=[])
  args = p.parse_args(argv)

  layer_map = tuple(int(x) for x in args.layer_map.split(","))
  cfg = config_lib.load(args.config, args.overrides, args.configs_dir)
  shallow = dataclasses.replace(
    cfg,
    model=dataclasses.replace(
      cfg.model, num_layers=max(layer_map) + 1, layer_order=()
    ),
  )
  deep = dataclasses.replace(
    cfg,
    model=dataclasses.replace(
      cfg.model, num_layers=len(layer_map), layer_order=()
    ),
  )
  upscaled_start(
    loop.Trainer.create(shallow, args.src),
    loop.Trainer.create(deep, args.dst),
    layer_map,
  )
  print(f"wrote step-0 checkpoint of {len(layer_map)} blocks to {args.dst}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
