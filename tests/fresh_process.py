"""What a fresh Python process imports: the checks that a module keeps a heavy import out."""

import json
import subprocess
import sys
from pathlib import Path


def imported_by(code: str, modules: tuple[str, ...], cwd: Path | None = None) -> list[str]:
    """Which of ``modules``, or of their submodules, a fresh Python process has imported after
    running ``code`` (which must succeed)."""
    listed = (f"\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules "
              f"if any(m == n or m.startswith(n + '.') for n in {list(modules)!r}))))")
    done = subprocess.run([sys.executable, "-c", code + listed], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
