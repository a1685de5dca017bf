"""Entry point: `python -m launcher` or `torchrun ... -m launcher`."""

import sys

from launcher.main import main

if __name__ == "__main__":
    sys.exit(main())
