"""PyTorch's ``torch.distributed.tensor._ops.utils``, at the same path: this module is ``_torch_compat.ops_utils``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from .._torch_compat import ops_utils

sys.modules[__name__] = ops_utils
