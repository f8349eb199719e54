"""What several test modules share: the models they train (``transformer``, ``mlp``), their meshes
(``meshes``), the readers of lowered and compiled programs (``hlo``), the PyTorch twin's helpers (``torch_twin``).

Test modules import from here, never from each other (tests/conftest.py's directory is on ``sys.path``, so
``from support import transformer`` works in every test process, xdist workers and subprocesses included).
"""
