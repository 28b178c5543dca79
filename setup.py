"""Maps the repository's top-level folders to the installed ``kvserve.*`` names.

The repository keeps ``service/``, ``cachestore/`` and ``clients/`` at its root; the
distribution installs them as ``kvserve.service``, ``kvserve.cachestore`` and
``kvserve.clients`` (``kvserve`` is a namespace package, shared with the kvserve-client
distribution). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = ("service", "cachestore", "clients")

packages = [f"kvserve.{root}" for root in ROOTS]
for root in ROOTS:
    packages += [f"kvserve.{root}.{sub}" for sub in find_packages(root, exclude=["node*"])]

setup(
    packages=packages,
    package_dir={f"kvserve.{root}": root for root in ROOTS},
    package_data={"kvserve.service": ["default_model/*", "models/native/*.cpp", "models/native/*.h"]},
)
