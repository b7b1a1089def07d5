"""The packages' lazy names are what their docs import: a function, not the submodule of the same name.

``chameleon_dist.integrations.megatron`` has a submodule ``install`` and a lazy name ``install`` (the function the
README's three Megatron lines call). Loading the submodule binds the package's ``install`` to the module; the
README's ``from chameleon_dist.integrations.megatron import install`` then gave the module ("'module' object is not
callable"). Each check runs in a fresh interpreter, where nothing has loaded the submodule yet.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECKS = {
    "megatron install": "from chameleon_dist.integrations.megatron import install\n"
                        "assert callable(install) and install.__name__ == 'install', install\n"
                        "import chameleon_dist.integrations.megatron as package\n"
                        "assert package.install is install, package.install\n",
    "every megatron name": "import chameleon_dist.integrations.megatron as package, inspect\n"
                           "for name in package._LAZY:\n"
                           "    assert not inspect.ismodule(getattr(package, name)), name\n",
}


@pytest.mark.parametrize("source", CHECKS.values(), ids=CHECKS.keys())
def test_a_lazy_name_is_the_object_not_the_submodule(source):
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
