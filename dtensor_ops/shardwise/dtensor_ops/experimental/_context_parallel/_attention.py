"""PyTorch's ``experimental._context_parallel._attention``, at the same path: this module is ``experimental._attention``, the context-parallel API.

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names.
"""

import sys

from .. import _attention

sys.modules[__name__] = _attention
