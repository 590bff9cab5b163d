"""The first import of every backends/easel_*/model.py, as `easel_bootstrap` (easel serve copies
this file beside each model.py: clients/triton_install.py): the deployment's folders on sys.path.

Triton's stub embeds a Python that ignores PYTHONPATH: its sys.path holds the interpreter's own
folders, the model's folder and the stub's working directory (where the assembled backend folder,
also named `backends`, would shadow this project's). Each PYTHONPATH folder (the project, the
venv's site-packages, a numpy<2 folder for Triton 2.51's stub) is added as a site directory, its
.pth files too, ahead of the interpreter's own, as PYTHONPATH would be. Importing the module does
it once per process, before numpy or torch is imported.
"""

import os
import site
import sys


def put_pythonpath_first() -> None:
    own = list(sys.path)
    for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if folder:
            site.addsitedir(folder)
    sys.path[:] = [p for p in sys.path if p not in own] + own


put_pythonpath_first()
