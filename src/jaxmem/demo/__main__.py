"""``python -m jaxmem.demo``: the memory demo (same as ``python -m jaxmem demo``)."""

import sys

from jaxmem.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
