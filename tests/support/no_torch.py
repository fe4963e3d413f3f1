"""``ferrum-service`` with ``torch`` and ``transformers`` refused at import, as on a base install
(no ``models`` extra): ``python tests/support/no_torch.py serve ARGS...``.

A finder at the front of ``sys.meta_path`` raises ModuleNotFoundError for those packages and their
submodules, whether or not the venv has them, so any import of them on the served path fails the
server (an import that handles ImportError, as a base install needs, goes on without them).
"""

from __future__ import annotations

import sys

BLOCKED = ("torch", "transformers")


class RefuseTorch:
    """A meta-path finder that refuses :data:`BLOCKED` and their submodules."""

    def find_spec(self, name: str, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (refused: torch-free check)", name=name)
        return None


def main() -> int:
    sys.meta_path.insert(0, RefuseTorch())
    from ferrum_service.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
