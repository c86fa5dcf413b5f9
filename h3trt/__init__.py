"""h3trt: a compiled inference engine for MiniMax-H3.

Importing the package changes nothing in the interpreter or its environment; the entry points set up the bytecode
cache they need (h3trt/paths.py, `use_bytecode_cache`).
"""
