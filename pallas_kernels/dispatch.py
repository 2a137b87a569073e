"""Choosing an implementation: one switch shared by every op.

`implementation=None` picks the fastest correct one for the platform (the
Mosaic GPU kernels on a Hopper GPU, else the reference); a user can force
one by name. Each op registers its implementations in a dict
`name -> callable`, with "xla" (the plain `jnp` reference) always present.
`default_implementation("xla")` makes every `implementation=None` inside
it (at trace time) take the references instead: a whole model, written
without naming implementations, runs on the references for a check.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping

import jax

_DEFAULT = threading.local()

# CUDA compute capability of Hopper, the GPU the Mosaic kernels are for.
HOPPER_CAPABILITY = "9.0"


def compute_capability() -> str | None:
  """This process's GPU's CUDA compute capability ("9.0"), None off-GPU."""
  if jax.default_backend() != "gpu":
    return None
  return getattr(jax.local_devices()[0], "compute_capability", "unknown")


def hopper() -> bool:
  """Whether this process runs on a Hopper GPU (CUDA compute capability
  9.0: H100, H200, H20, H800), the one the Mosaic GPU kernels are written
  for (wgmma, TMA, warp specialization). Other GPUs (an A100, a Blackwell)
  take the XLA references by default instead of failing to compile."""
  return compute_capability() == HOPPER_CAPABILITY


@contextlib.contextmanager
def default_implementation(
  name: str | None, ops: tuple[str, ...] | None = None
) -> Iterator[None]:
  """Inside: ops called with `implementation=None` use `name` ("xla" or
  "mosaic") where they have it, else "xla"; None restores the platform's
  choice. `ops`: only these ops (e.g. `("rms_norm",)`, to time a model
  with one family on XLA); None, all of them. Read while tracing; jit's
  trace cache does not key on it, so a change of choice clears JAX's
  caches on the way in and out (a function traced outside is traced
  again inside, not served the other choice's trace)."""
  old = getattr(_DEFAULT, "name", None), getattr(_DEFAULT, "ops", None)
  new = (name, ops)
  if new != old:
    jax.clear_caches()
  _DEFAULT.name, _DEFAULT.ops = new
  try:
    yield
  finally:
    _DEFAULT.name, _DEFAULT.ops = old
    if new != old:
      jax.clear_caches()


def pick(
  op: str,
  implementations: Mapping[str, Callable],
  implementation: str | None,
  gpu_default: str,
) -> Callable:
  cc = compute_capability()
  forced = getattr(_DEFAULT, "name", None)
  scope = getattr(_DEFAULT, "ops", None)
  if scope is not None and op not in scope:
    forced = None
  if implementation is None and forced is not None:
    implementation = forced if forced in implementations else "xla"
  if implementation is None:
    implementation = gpu_default if cc == HOPPER_CAPABILITY else "xla"
    if implementation not in implementations:
      implementation = "xla"
  elif implementation == "mosaic" and cc not in (None, HOPPER_CAPABILITY):
    raise ValueError(
      f"{op}: the Mosaic GPU kernels need a Hopper GPU (compute "
      f"capability 9.0), this one's is {cc}; implementation=None or "
      "'xla' runs the reference here"
    )
  try:
    return implementations[implementation]
  except KeyError:
    raise ValueError(
      f"{op}: unknown implementation {implementation!r}; "
      f"choose one of {sorted(implementations)} or None"
    ) from None
