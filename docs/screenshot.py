"""Make the README's pictures: the real TUI on the real nan demo, SVG at 120x40 and 80x24."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from demo_job import demo_job  # noqa: E402

from tdbg.tui.app import make_app, save_screenshot, screen_text  # noqa: E402
from tdbg.tui.sources.base import SocketSource  # noqa: E402


async def capture(out: Path, size: tuple[int, int] = (160, 48), timeout: float = 60.0) -> str:
    """Run the nan demo, attach the app under its Pilot, wait for the alert and the automatic
    NaN hunt's answer, save an SVG."""
    runtime = Path(tempfile.mkdtemp(prefix="tdbg-shot-", dir="/tmp"))
    os.chmod(runtime, 0o700)
    args = ("--delay", "0.004", "--nan-at", "700", "--layer", "body.2", "--steps", "100000")
    with demo_job("nan", *args, runtime=runtime) as (_proc, entry):
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + timeout
            # The first non-finite alert starts the automatic NaN hunt: wait for its answer
            # too, so the picture shows the module it names.
            while not (
                app.state.nonfinite_alerts
                and app.state.deep.nan_hunt is not None
                and app.state.system is not None
                and " (l)" in screen_text(app)
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError("the demo never showed its alert and NaN hunt")
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # let the charts take in a few more steps
            await pilot.pause()
            return save_screenshot(app, out)


SIZES = ((120, 40), (80, 24))

if __name__ == "__main__":
    # The pictures show what a new user sees: not the settings this machine's user saved.
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="tdbg-shot-config-")
    for width, height in SIZES:
        target = ROOT / "docs" / f"screenshot-{width}x{height}.svg"
        print(asyncio.run(capture(target, (width, height))))
