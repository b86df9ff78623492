# A package, so pytest imports kernels/conftest.py as `kernels.conftest` and it
# cannot shadow server/tests/conftest.py, which that folder's tests import as
# the top-level module `conftest`.
