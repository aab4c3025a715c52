"""PyTorch's ``torch.distributed.tensor._dtensor_spec``, at the same path: this module is ``_torch_compat.dtensor_spec``.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names (see ``_torch_compat/__init__.py``).
"""

import sys

from ._torch_compat import dtensor_spec

sys.modules[__name__] = dtensor_spec
