"""pytest in docs/: the pages' ``>>>`` examples run as doctests (pyproject's --doctest-glob);
the Sphinx configuration, the build and the notebooks copied for it are not tests."""

collect_ignore = ["conf.py"]
collect_ignore_glob = ["_build/*", "notebooks/*"]
