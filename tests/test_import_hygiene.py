"""Dependencies point one way: the probe never imports textual/rich, the wire never imports torch,
and ``import tdbg`` is cheap. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def modules_after(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_import_tdbg_is_light() -> None:
    loaded = roots(modules_after("import tdbg; tdbg.__version__"))
    assert "tdbg" in loaded
    assert not loaded & {"torch", "textual", "rich", "numpy", "psutil"}


def test_wire_client_and_runtime_import_no_torch() -> None:
    loaded = modules_after("import tdbg.protocol, tdbg.connect.client, tdbg.connect.runtime")
    assert {"tdbg.protocol", "tdbg.connect.client", "tdbg.connect.runtime", "msgpack"} <= loaded
    assert not roots(loaded) & {"torch", "textual", "rich", "cloudpickle"}


def test_probe_imports_no_textual_or_rich() -> None:
    loaded = modules_after("import tdbg.probe.watch")
    assert "torch" in roots(loaded)  # the probe's own import is real
    assert not roots(loaded) & {"textual", "rich"}
    assert not any(m.startswith("tdbg.tui") for m in loaded)


def test_watch_attribute_loads_the_probe_lazily() -> None:
    loaded = modules_after("import tdbg; tdbg.watch")
    assert "tdbg.probe.watch" in loaded and not roots(loaded) & {"textual", "rich"}


def test_unknown_attribute_is_an_attribute_error() -> None:
    import tdbg

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tdbg.nope  # noqa: B018
