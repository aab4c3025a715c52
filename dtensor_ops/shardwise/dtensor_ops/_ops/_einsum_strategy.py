"""PyTorch's ``torch.distributed.tensor._ops._einsum_strategy``, at the same path: this module is ``_torch_compat.einsum_strategy``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from .._torch_compat import einsum_strategy

sys.modules[__name__] = einsum_strategy
