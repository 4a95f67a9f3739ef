"""Tests of the data set browser (tarshards.web, tarshards browse); a package, so that its
conftest.py is ``web.conftest`` and not a second top-level ``conftest`` beside tests/conftest.py
(which test modules import by that name)."""
