"""Installs partita's start-up hook beside the package (everything else is in pyproject.toml).

``partita-as-deepspeed.pth`` goes to the root of site-packages, where Python runs it at start-up:
it makes ``import deepspeed`` resolve to partita only in processes whose environment sets
``PARTITA_AS_DEEPSPEED=1`` (see `partita.compat.alias`). setuptools has no declarative way to put a
file at the root of site-packages, so build_py copies it there: into the wheel's root for a normal
install, and into the editable wheel's root for ``pip install -e``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = Path(__file__).parent / "src" / "partita-as-deepspeed.pth"


class BuildPyWithHook(build_py):
    """build_py that also places the start-up hook at the root of what gets installed."""

    def run(self) -> None:
        super().run()
        root = self.build_lib
        if getattr(self, "editable_mode", False):
            # An editable wheel installs what lands in the install command's lib folder.
            root = self.get_finalized_command("install").install_lib
        self.copy_file(str(HOOK), str(Path(root) / HOOK.name))


setup(cmdclass={"build_py": BuildPyWithHook})
