"""Prints the requirements .ci/setup.sh installs, one a line, for the python that runs it.

    python .ci/requirements.py --spec xgrammar   # the project's own requirement on xgrammar
    python .ci/requirements.py test bench        # the project's and those extras', xgrammar's in its place

xgrammar asks for triton on x86-64 Linux: 1 GB of GPU compilers that nothing batchyard runs on the
CPU needs (its grammar masks are applied by xgrammar's CPU code). setup.sh installs xgrammar without
its dependencies first; this then lists, in xgrammar's place, what that installed xgrammar requires
less triton, so a fresh machine needs ~1 GB less disk. A `pip install batchyard` takes triton as usual.
"""

import importlib.metadata
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip carries the same parser
    from pip._vendor import tomli as tomllib
from pip._vendor.packaging.requirements import Requirement

LEFT_OUT = {"triton"}


def project_requirements(extras):
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def installed_requirements(name):
    for line in importlib.metadata.requires(name) or []:
        req = Requirement(line)
        if req.name in LEFT_OUT or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        yield req


def main(argv):
    if argv[:1] == ["--spec"]:
        name = argv[1]
        print(next(str(req) for req in project_requirements([]) if req.name == name))
        return
    for req in project_requirements(argv):
        for line in installed_requirements(req.name) if req.name == "xgrammar" else [req]:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
