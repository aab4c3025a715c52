"""PyTorch's ``torch.distributed._tensor.device_mesh``, at the same path: this module is ``_torch_compat.device_mesh``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from ._torch_compat import device_mesh

sys.modules[__name__] = device_mesh
