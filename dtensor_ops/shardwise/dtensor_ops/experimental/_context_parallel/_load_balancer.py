"""PyTorch's ``experimental._context_parallel._load_balancer``, at the same path: this module is ``experimental._cp_layout``, the load balancers (with the layouts they produce).

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names.
"""

import sys

from .. import _cp_layout

sys.modules[__name__] = _cp_layout
