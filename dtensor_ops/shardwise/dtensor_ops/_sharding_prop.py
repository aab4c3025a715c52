"""PyTorch's ``torch.distributed.tensor._sharding_prop``, at the same path: this module is ``_torch_compat.sharding_prop``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from ._torch_compat import sharding_prop

sys.modules[__name__] = sharding_prop
