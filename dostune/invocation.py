"""The command line that produced a record, for provenance fields."""
import os
import shlex
import sys


def invocation() -> str:
    prog = os.path.basename(sys.argv[0])
    if prog in ("__main__.py", "app.py"):  # python -m dostune
        prog = "dostune"
    return shlex.join([prog] + sys.argv[1:])
