"""Choosing an implementation: one switch shared by every op.

`implementation=None` picks the fastest correct one for the platform; a user
can force one by name. Each op registers its implementations in a dict
`name -> callable`, with "xla" (the plain `jnp` reference) always present.
"""

from collections.abc import Callable, Mapping

import jax


def default_backend() -> str:
  return jax.default_backend()


def pick(
  op: str,
  implementations: Mapping[str, Callable],
  implementation: str | None,
  gpu_default: str,
) -> Callable:
  if implementation is None:
    implementation = gpu_default if default_backend() == "gpu" else "xla"
    if implementation not in implementations:
      implementation = "xla"
  try:
    return implementations[implementation]
  except KeyError:
    raise ValueError(
      f"{op}: unknown implementation {implementation!r}; "
      f"choose one of {sorted(implementations)} or None"
    ) from None
