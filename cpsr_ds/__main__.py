"""``python -m cpsr_ds``: the command line of :mod:`cpsr_ds.cli`, its report alone on stdout.

``--json`` output must reach ``jq`` untouched, yet importing DeepSpeed logs through a handler it binds to
stdout (its accelerator warning), as does cpsr_ds's own logger. So before anything imports them, file
descriptor 1 becomes stderr, and the report is written to a copy of the original stdout. Only this
entry point does so: a program that imports cpsr_ds keeps its streams as they are.
"""

import os
import sys


def report_stream():
    """A stream on the process's stdout for the report; from here on whatever else writes to stdout (a
    logging handler bound to it, a print, a child process) writes to stderr."""
    report = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return report


if __name__ == "__main__":
    with report_stream() as out:
        from cpsr_ds.cli import main  # imports DeepSpeed: only once stdout is the report's alone

        code = main(out=out)
    sys.exit(code)
