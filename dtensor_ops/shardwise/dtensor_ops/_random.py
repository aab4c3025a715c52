"""PyTorch's ``torch.distributed.tensor._random``, at the same path: this module is ``_torch_compat.random``.

Importing it binds that module under this name too, so attributes (``_rng_tracker`` included), identity and
monkeypatching are those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from ._torch_compat import random

sys.modules[__name__] = random
