"""``python pause_at_stage.py CLI-ARGS…``: the CLI with a stage hook on the door that, at the stage
``$PRIVPROMPT_TEST_PAUSE_AT`` names (``<stage>:<marker file>``), writes this process's pid to the
marker file and waits there, so that tests/claims/test_crash_stages.py can kill the run at a known
point (``tasks.lifecycle.STAGES``)."""

import os
import sys
import time
from pathlib import Path

PAUSE_ENV = "PRIVPROMPT_TEST_PAUSE_AT"


def main() -> int:
    stage, _, marker = os.environ[PAUSE_ENV].partition(":")
    from tasks import lifecycle

    assert stage in lifecycle.STAGES, stage

    def pause(name: str) -> None:
        if name == stage:
            Path(marker).write_text(str(os.getpid()))
            time.sleep(300)  # the test kills the process here; bounded, so a forgotten run still ends

    lifecycle.STAGE_HOOKS.append(pause)
    from privprompt_cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
