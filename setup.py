"""setuptools glue: the extension modules are compiled by build.py (not by distutils)."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location("jaxquant_build", Path(__file__).with_name("build.py"))
jq_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jq_build)


class BuildExt(build_ext):
    def build_extension(self, ext):
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        if ext.name.endswith("_cuda"):
            jq_build.build_cuda(out, verbose=self.verbose > 1)
        else:
            jq_build.build_cpu(out, verbose=self.verbose > 1)


_cuda = jq_build.want_cuda()
if not _cuda:  # an editable install loads extensions from the source tree: no stale CUDA module may stay there
    jq_build.remove_stale_cuda()
modules = ["jaxquant._jaxquant_cpu"] + (["jaxquant._jaxquant_cuda"] if _cuda else [])
setup(ext_modules=[Extension(name, sources=[]) for name in modules], cmdclass={"build_ext": BuildExt})
