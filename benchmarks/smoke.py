"""Host setup for the kernel benchmarks' CPU dry runs (`--smoke`).

GPU interpret mode runs each warpgroup as a separate XLA:CPU program on its
own Python thread; with the default host client on a small machine they
were seen to deadlock (`benchmarks/jagged_attention.py --smoke` hung).
Eight host devices, as tests/conftest.py sets, avoid it. XLA reads its
flags when JAX starts, so a benchmark sets them before importing jax:

    os.environ["XLA_FLAGS"] = smoke.xla_flags(sys.argv)
"""

import os

FLAG = "--xla_force_host_platform_device_count=8"


def xla_flags(argv) -> str:
  """`XLA_FLAGS` with `FLAG` added when `argv` asks for a smoke run."""
  flags = os.environ.get("XLA_FLAGS", "")
  return f"{flags} {FLAG}".strip() if "--smoke" in argv else flags
