"""Where the templates and search spaces live: inside the installed package, or beside it in a checkout."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """`templates` or `search`: shipped inside the wheel, at the repository root in a source checkout."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"mage-gen's {name}/ folder is missing; reinstall mage-gen")
