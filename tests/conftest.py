"""Settings for the whole test suite."""

from __future__ import annotations

import torch

# The tiny test models' matrices are a few dozen wide: the CPU thread pool's hand-offs cost far more than
# the arithmetic (x100 on a loaded two-core machine), for transformers and for us alike.
torch.set_num_threads(1)
