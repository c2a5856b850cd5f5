"""Maps the top-level folders to ``undertow.*`` import names (see docs/design.md, "Layout").

Subpackages are discovered so that adding a folder needs no edit here.
"""

from setuptools import find_packages, setup

FOLDERS = {"undertow": "undertow", "undertow.gateway": "gateway",
           "undertow.adapters": "adapters", "undertow.learner": "learner",
           "undertow.sandboxes": "sandboxes"}


def _packages():
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        packages.append(name)
        package_dir[name] = folder
        for sub in find_packages(folder):
            packages.append(f"{name}.{sub}")
            package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, include_package_data=True)
