import sys

from splitserve.cli import main

if __name__ == "__main__":  # not when a spawned child (multiprocessing) imports the parent's main module
    sys.exit(main())
