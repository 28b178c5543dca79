"""python -m kvserve.service.kernels: build the native kernels in place (build.py)."""

import sys

from kvserve.service.kernels.build import main

sys.exit(main())
