"""``python -m kvserve.service [flags]`` is ``kvserve serve [flags]``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]], exit_now=True))
