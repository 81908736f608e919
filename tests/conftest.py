"""Suite-wide settings.

executor.rng compiles its Philox kernel on the first draw of every process by default;
the suite draws eagerly (the same bits) so that each spawned rank does not pay the
compile, and tests/test_rng.py checks the compiled kernel against the eager one.
Spawned ranks inherit the environment."""

import os

os.environ.setdefault("MESHPLAN_RNG_KERNEL", "eager")
