from splitserve.cli import main
from splitserve.common.process_exit import exit_now

if __name__ == "__main__":  # not when a spawned child (multiprocessing) imports the parent's main module
    # a process of its own: its exit skips the teardown of what it imported (torch: seconds of CPU; process_exit.py)
    exit_now(main())
