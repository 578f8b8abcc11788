"""``python -m tdbg.cli``: the ``tdbg`` command, for environments without its console script."""

import sys

from tdbg.cli.entry import main

sys.exit(main())
