"""python -m rpc_harness SCRIPT ARGS...: the same as the command rpcrun (supervisor.main)."""

import sys

from .supervisor import main

if __name__ == "__main__":
    sys.exit(main())
