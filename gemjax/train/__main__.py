"""`python -m gemjax.train --config NAME [--set key=value ...]`.

Trains a named config, `configs/<NAME>.py` under the working directory
(`--configs-dir` for another directory, or `--config path/to/file.py`),
prints a live progress line and a final metrics table, and leaves
checkpoints and `metrics.jsonl` in the run directory (`train.run_dir`,
default `runs/<config>`). Running it again on the same run directory
resumes from the latest checkpoint (the same model and data config, or
`--allow-config-change`; another `train.steps` extends the run). SIGTERM
saves a checkpoint at the next step and exits with status 143.

Multi-host: when `GEMJAX_COORDINATOR` (host:port), `GEMJAX_NUM_PROCESSES` and
`GEMJAX_PROCESS_ID` are set, `jax.distributed.initialize` joins the processes
before anything else touches a device. The run directory is shared by all
processes, or, when it names `{process}` (replaced by the process id), one
per process (see `gemjax.train.checkpoint`).
"""

import argparse
import os
import signal
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m gemjax.train", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--config", default="smoke", help="a name in --configs-dir, or a .py file"
  )
  p.add_argument(
    "--configs-dir",
    default="configs",
    help="directory of named configs (default: ./configs)",
  )
  p.add_argument(
    "--set",
    dest="overrides",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override a config field",
  )
  p.add_argument(
    "--run-dir",
    default=None,
    help="default: train.run_dir; {process} in it: one per process",
  )
  p.add_argument(
    "--allow-config-change",
    action="store_true",
    help="resume a run dir whose checkpoint has another model/data config",
  )
  args = p.parse_args(argv)
  if args.allow_config_change:
    args.overrides.append("train.allow_config_change=true")

  from gemjax import config as config_lib

  try:
    cfg = config_lib.load(args.config, args.overrides, args.configs_dir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _maybe_init_distributed()

  from gemjax import metrics
  from gemjax.train.checkpoint import CannotResume
  from gemjax.train.loop import train
  from gemjax.train.runtime import Preempted

  try:
    result = train(cfg, args.run_dir)
  except Preempted as e:
    print(f"\n{e}", file=sys.stderr)
    return 128 + signal.SIGTERM  # the shell's code for "ended by SIGTERM"
  except CannotResume as e:  # one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(metrics.format_table(result))
  return 0


def _maybe_init_distributed() -> None:
  coord = os.environ.get("GEMJAX_COORDINATOR")
  if not coord:
    return
  import jax

  jax.distributed.initialize(
    coordinator_address=coord,
    num_processes=int(os.environ["GEMJAX_NUM_PROCESSES"]),
    process_id=int(os.environ["GEMJAX_PROCESS_ID"]),
  )


if __name__ == "__main__":
  sys.exit(main())
