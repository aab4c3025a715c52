"""PyTorch's ``experimental._context_parallel._cp_custom_ops``, at the same path: this module is ``experimental._cp_flex``, the flex all-gather custom op (with the rest of flex context parallelism).

Importing it binds that module under this name too, so attributes, identity and monkeypatching are
those of the one module that holds the names.
"""

import sys

from .. import _cp_flex

sys.modules[__name__] = _cp_flex
