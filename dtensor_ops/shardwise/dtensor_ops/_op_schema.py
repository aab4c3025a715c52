"""PyTorch's ``torch.distributed.tensor._op_schema``, at the same path: this module is ``_torch_compat.op_schema``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from ._torch_compat import op_schema

sys.modules[__name__] = op_schema
