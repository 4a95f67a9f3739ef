"""The command-line tools: ``tarscat``, ``tar2tsv``, ``tarsplit``, ``tarshow``, ``tarproc``,
``tarpcat``, ``tarsort``, ``tarcheck``, also reachable as ``tarshards cat``, ``tarshards tsv``...

This package is the only place that imports click; each tool is a thin layer over the library.
One module per command (``cat.py``, ``tsv.py``, ``split.py``...); the options several tools
share, the error reporting and the exit codes are in ``_common.py``; ``main.py`` registers the
commands (one line each in ``COMMANDS``) and holds the script entry points.
"""
