"""Command line: export a run's scorers, or serve it over HTTP.

python -m gemjax.serve export RUN_DIR OUT_DIR [--step N] [--shapes 1x128,8x512]
python -m gemjax.serve http RUN_DIR [--port 8000] [--host 127.0.0.1]
python -m gemjax.serve http --export OUT_DIR [--port 8000]
"""

import argparse
import sys

from gemjax.serve import batching


def _shapes(text: str):
  try:
    out = tuple(
      tuple(int(x) for x in part.split("x")) for part in text.split(",")
    )
  except ValueError:
    out = ()
  if not out or any(len(s) not in (2, 3, 4) for s in out):
    raise argparse.ArgumentTypeError(
      f"--shapes {text!r}: expected REQUESTSxCANDIDATES[xPER_REQUEST"
      "[xTOKENS]],... e.g. 1x128,8x512x128"
    )
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m gemjax.serve")
  sub = p.add_subparsers(dest="cmd", required=True)
  shapes = ",".join(f"{b}x{c}" for b, c in batching.DEFAULT_SHAPES)
  ex = sub.add_parser("export", help="write every bucket's scorer")
  ex.add_argument("run_dir")
  ex.add_argument("out_dir")
  ex.add_argument("--step", type=int, default=None)
  ex.add_argument(
    "--shapes",
    type=_shapes,
    default=batching.DEFAULT_SHAPES,
    help=f"buckets, default {shapes}",
  )
  ht = sub.add_parser("http", help="serve POST /v1/score")
  ht.add_argument("run_dir", nargs="?")
  ht.add_argument("--export", default=None, help="serve an exported dir")
  ht.add_argument("--step", type=int, default=None)
  ht.add_argument("--shapes", type=_shapes, default=batching.DEFAULT_SHAPES)
  ht.add_argument("--host", default="127.0.0.1")
  ht.add_argument("--port", type=int, default=8000)
  ht.add_argument("--max-wait-ms", type=float, default=5.0)
  ht.add_argument("--max-queue", type=int, default=64)
  ht.add_argument("--deadline-ms", type=float, default=1000.0)
  ht.add_argument(
    "--cache-mb",
    type=float,
    default=0.0,
    help="history cache size (MB); 0 = off",
  )
  args = p.parse_args(argv)

  from gemjax.serve.ranker import Ranker

  if args.cmd == "export":
    ranker = Ranker.from_checkpoint(args.run_dir, args.step, shapes=args.shapes)
    for f in ranker.export(args.out_dir):
      print(f)
    return 0
  if (args.run_dir is None) == (args.export is None):
    p.error("http: give RUN_DIR or --export OUT_DIR (one of them)")
  if args.export:
    if args.cache_mb:
      p.error("http --export: the history cache needs the checkpoint")
    ranker = Ranker.from_export(args.export)
  else:
    ranker = Ranker.from_checkpoint(
      args.run_dir,
      args.step,
      shapes=args.shapes,
      cache_bytes=int(args.cache_mb * 2**20),
    )
  from gemjax.serve.http import serve

  serve(
    ranker,
    host=args.host,
    port=args.port,
    max_wait_ms=args.max_wait_ms,
    max_queue=args.max_queue,
    deadline_ms=args.deadline_ms,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
