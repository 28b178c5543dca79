"""kvserve's import names from a source checkout.

An installed kvserve provides ``kvserve.service``, ``kvserve.cachestore`` and
``kvserve.clients`` (pyproject.toml / setup.py map the repository's top-level folders
``service/``, ``cachestore/`` and ``clients/`` under one ``kvserve`` namespace). From a
checkout without installing (``PYTHONPATH=.``, ``python -m pytest`` in the repository
root, a second worktree), this package resolves the same names to the folders beside it,
so the checkout's code is what runs. It is not part of any distribution.
"""

import os as _os

__path__ = [_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))]
