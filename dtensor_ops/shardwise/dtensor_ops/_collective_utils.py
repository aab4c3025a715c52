"""PyTorch's ``torch.distributed.tensor._collective_utils``, at the same path: this module is ``_torch_compat.collective_utils``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from ._torch_compat import collective_utils

sys.modules[__name__] = collective_utils
