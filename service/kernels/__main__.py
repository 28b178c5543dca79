"""python -m kvserve.service.kernels: build the native kernels in place (build.py)."""

import sys

from .build import main

sys.exit(main())
