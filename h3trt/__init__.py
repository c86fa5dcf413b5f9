"""h3trt: a compiled inference engine for MiniMax-H3.

Importing the package first makes sure Python keeps compiled bytecode for what h3trt imports next (h3trt/paths.py,
`use_bytecode_cache`): each spawned rank imports this package before torch.
"""

from .paths import use_bytecode_cache

use_bytecode_cache()
