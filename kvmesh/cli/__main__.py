"""``python -m kvmesh.cli``: the same command as the ``kvmesh`` console script."""

from . import main

main()
