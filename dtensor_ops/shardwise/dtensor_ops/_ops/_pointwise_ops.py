"""PyTorch's ``torch.distributed.tensor._ops._pointwise_ops``, at the same path: this module is ``_torch_compat.pointwise_ops``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from .._torch_compat import pointwise_ops

sys.modules[__name__] = pointwise_ops
