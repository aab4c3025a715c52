"""PyTorch's ``torch.distributed.tensor._redistribute``, at the same path: this module is ``_torch_compat.redistribute``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).  The executor
itself is ``_redistribution``.
"""

import sys

from ._torch_compat import redistribute

sys.modules[__name__] = redistribute
