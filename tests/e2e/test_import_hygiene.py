"""Dependencies point one way, checked at run time: each check imports in a fresh interpreter and
looks at what got loaded. The same rules are declared for lint in pyproject.toml
([tool.importlinter]); this test also sees imports that a static graph cannot (``importlib``,
``__getattr__``) and proves that ``import tdbg`` stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Every top-level part of tdbg except the probe: subpackages and loose modules alike, found on
# disk so that a new one (tdbg/format.py, say) is checked without editing this list.
READERS = sorted(
    p.stem
    for p in (REPO / "tdbg").iterdir()
    if p.name not in ("probe", "__init__.py", "__pycache__")
    and ((p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py")
)
SHARED = ("protocol", "connect", "recording", "format")  # below both the probe and the readers

# Imports every module of ``tdbg.<part>`` (but never a __main__, which would run the command).
IMPORT_ALL = """
import importlib, pkgutil
part = importlib.import_module({name!r})
for info in pkgutil.walk_packages(getattr(part, "__path__", []), part.__name__ + "."):
    if not info.name.endswith(".__main__"):
        importlib.import_module(info.name)
"""


def modules_after(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def under(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


def test_the_parts_are_found() -> None:
    assert {"protocol", "connect", "recording", "format", "model", "tui", "cli"} <= set(READERS)


def test_import_tdbg_is_light() -> None:
    loaded = roots(modules_after("import tdbg; tdbg.__version__"))
    assert "tdbg" in loaded
    assert not loaded & {"torch", "textual", "rich", "numpy", "psutil"}


@pytest.mark.parametrize("part", READERS)
def test_no_part_but_the_probe_loads_torch(part: str) -> None:
    loaded = modules_after(IMPORT_ALL.format(name=f"tdbg.{part}"))
    assert f"tdbg.{part}" in loaded
    assert "torch" not in roots(loaded)
    assert not under(loaded, "tdbg.probe")


@pytest.mark.parametrize("part", SHARED)
def test_shared_layers_load_no_ui(part: str) -> None:
    loaded = modules_after(IMPORT_ALL.format(name=f"tdbg.{part}"))
    assert not roots(loaded) & {"textual", "rich", "cloudpickle"}
    assert not under(loaded, "tdbg.tui") | under(loaded, "tdbg.cli")


def test_protocol_loads_nothing_of_tdbg_but_itself() -> None:
    loaded = modules_after(IMPORT_ALL.format(name="tdbg.protocol"))
    assert "msgpack" in roots(loaded)
    assert not roots(loaded) & {"numpy", "psutil"}
    assert {m for m in under(loaded, "tdbg") if m != "tdbg"} <= under(loaded, "tdbg.protocol")


def test_cli_and_tui_entry_points_load_no_torch() -> None:
    loaded = modules_after(
        "import tdbg.cli.main, tdbg.cli.launch, tdbg.tui.app, tdbg.tui.replay_app"
    )
    assert "textual" in roots(loaded)  # the app's own import is real
    assert "torch" not in roots(loaded)
    assert not under(loaded, "tdbg.probe")


def test_the_model_loads_no_ui_and_no_sockets() -> None:
    """The run model, verdicts, jobs, deep-dive results and timeline are plain Python: usable
    from a notebook or a script, testable without an app, reaching no socket."""
    loaded = modules_after(IMPORT_ALL.format(name="tdbg.model"))
    assert {"tdbg.model.run_state", "tdbg.model.health", "tdbg.model.job"} <= loaded
    assert not roots(loaded) & {"textual", "rich", "torch"}
    assert not under(loaded, "tdbg.tui") | under(loaded, "tdbg.cli") | under(loaded, "tdbg.connect")


def test_probe_imports_no_textual_or_rich() -> None:
    loaded = modules_after(IMPORT_ALL.format(name="tdbg.probe"))
    assert {"tdbg.probe.watch", "tdbg.probe.dives.profiling"} <= loaded
    assert "torch" in roots(loaded)  # the probe's own import is real
    assert not roots(loaded) & {"textual", "rich"}
    assert not under(loaded, "tdbg.tui") | under(loaded, "tdbg.cli")


def test_watch_attribute_loads_the_probe_lazily() -> None:
    loaded = modules_after("import tdbg; tdbg.watch")
    assert "tdbg.probe.watch" in loaded and not roots(loaded) & {"textual", "rich"}


def test_unknown_attribute_is_an_attribute_error() -> None:
    import tdbg

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tdbg.nope  # noqa: B018


def test_no_import_circles_and_the_tui_layers_are_declared() -> None:
    """No import circle anywhere in tdbg (siblings at every depth), and apps > screens > widgets
    > sources inside the TUI: the contracts in pyproject.toml, so that lint fails on a new one."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed beside this Python")
    contracts = ["--contract", "acyclic", "--contract", "tui-layers"]
    out = subprocess.run(
        [str(lint), "--no-cache", "--no-logo", *contracts],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout, out.stdout
