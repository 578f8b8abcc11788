"""No torch: reports what it sees (argv, environment, modules), then exits with a chosen code."""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    seen = {
        "argv": sys.argv,
        "torch_imported": "torch" in sys.modules,
        "autowatch_loaded": "tdbg.probe.zero_code.autowatch" in sys.modules,
        "pythonpath": os.environ.get("PYTHONPATH"),
        "preload_on_path": any("zero_code/preload" in p for p in sys.path),
        "user_sitecustomize": getattr(sys.modules.get("sitecustomize"), "MARK", None),
    }
    print(json.dumps(seen))
    sys.stderr.write("to stderr\n")
    code = os.environ.get("ZC_EXIT")
    return int(code) if code else 0


if __name__ == "__main__":
    sys.exit(main())
