"""How an actor script goes on once its patches are in place: into the next wrapper named on its command line (so
actors stack, e.g. a liar that is also witnessed), else into dedloc-worker itself. Imported by its siblings as
``chain`` (a script's own folder is first on ``sys.path``)."""

import runpy
import sys

from dedloc_worker import cli


def go_on() -> None:
    if sys.argv[1].endswith(".py"):
        sys.argv.pop(0)
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        cli.main(sys.argv[1:])
