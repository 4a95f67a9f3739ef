"""The command-line tools: ``tarscat``, ``tar2tsv``, ``tarsplit``, ``tarshow``, ``tarproc``,
``tarpcat``, ``tarsort``, ``tarcheck``, also reachable as ``tarshards cat``, ``tarshards tsv``...

This package is the only place that imports click; each tool is a thin layer over the library.
"""
