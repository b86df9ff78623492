# A package, so pytest imports this folder's conftest.py as `tests.conftest`
# and it cannot shadow server/tests/conftest.py, which that folder's tests
# import as the top-level module `conftest`.
