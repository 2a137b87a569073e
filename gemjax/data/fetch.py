"""`make data`: the public logs the tests and examples read, cached in data/.

ml-100k (MovieLens 100K: 100,000 ratings of 1,682 movies by 943 users) as
RecBole atomic files ships inside the RecBole wheel on PyPI, so the package
index every machine of the project already reaches serves it:
`pip download --no-deps recbole==1.2.1`, then `ml-100k.inter` and
`ml-100k.item` are taken out of the wheel into `data/ml-100k/` at the
repository root (ignored by git). The files are checked against their
SHA-256 before they land, and written under a temporary name then renamed,
so a half-written or altered file is never read as the data set. Present
files are kept: running it again downloads nothing.

Run as `python -m gemjax.data.fetch [--root DIR]`; read the result with
`data.source=recbole data.path=data/ml-100k/ml-100k.inter`.
"""

import argparse
import hashlib
import pathlib
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2] / "data"
RECBOLE = "recbole==1.2.1"
# File in data/ml-100k -> (member of the wheel, SHA-256 of its bytes).
ML100K = {
  "ml-100k.inter": (
    "recbole/dataset_example/ml-100k/ml-100k.inter",
    "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
  ),
  "ml-100k.item": (
    "recbole/dataset_example/ml-100k/ml-100k.item",
    "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
  ),
}


def fetch_ml100k(root: pathlib.Path = ROOT) -> pathlib.Path:
  """data/ml-100k/ml-100k.inter (and .item), downloading them if missing."""
  dest = pathlib.Path(root) / "ml-100k"
  if all((dest / name).exists() for name in ML100K):
    print(f"{dest}: present", file=sys.stderr)
    return dest / "ml-100k.inter"
  dest.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run(
      [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        tmp,
        RECBOLE,
      ],
      check=True,
    )
    (wheel,) = pathlib.Path(tmp).glob("recbole-*.whl")
    with zipfile.ZipFile(wheel) as z:
      for name, (member, sha) in ML100K.items():
        data = z.read(member)
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
          raise RuntimeError(
            f"{wheel.name}:{member}: SHA-256 {got}, expected {sha}"
          )
        part = dest / (name + ".part")
        part.write_bytes(data)
        part.replace(dest / name)
  print(f"{dest}: {', '.join(ML100K)} from {RECBOLE}", file=sys.stderr)
  return dest / "ml-100k.inter"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", type=pathlib.Path, default=ROOT)
  fetch_ml100k(parser.parse_args(argv).root)


if __name__ == "__main__":
  main()
