"""The bench runs the kspeedfs it was asked to measure (``--ab-tree``, ``--kspeedfs-tree``).

``python -m`` puts its working directory ahead of ``PYTHONPATH``: started from a checkout,
the checkout's package was imported whatever tree came first on ``PYTHONPATH``, so A/B
runs measured one tree twice. ``bench.targets.package_cwd`` gives the directory to start
``KSPEEDFS`` in."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bench.targets import KSPEEDFS, package_cwd

REPO = Path(__file__).resolve().parents[2]


def _stub_tree(root: Path) -> Path:
    app = root / "kspeedfs" / "cli"
    app.mkdir(parents=True)
    (root / "kspeedfs" / "__init__.py").write_text("")
    (app / "__init__.py").write_text("")
    (app / "app.py").write_text("import kspeedfs\nprint(kspeedfs.__file__)\n")
    return root


def test_kspeedfs_started_from_a_checkout_imports_the_tree_first_on_pythonpath(
        tmp_path: Path) -> None:
    tree = _stub_tree(tmp_path / "tree")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    assert package_cwd(env) == str(tree)
    got = subprocess.run(KSPEEDFS, env=env, cwd=package_cwd(env), capture_output=True,
                         text=True, check=True).stdout.strip()
    assert got == str(tree / "kspeedfs" / "__init__.py")
    # what the bench did before: started in the checkout, the checkout shadows the tree
    shadowed = subprocess.run([KSPEEDFS[0], "-c", "import kspeedfs; print(kspeedfs.__file__)"],
                              env=env, cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    assert shadowed == str(REPO / "kspeedfs" / "__init__.py")


def test_without_pythonpath_the_caller_s_directory_is_kept() -> None:
    assert package_cwd({}) is None
