"""Rewrite families: code that turns a finding into an Edit. They read the tree through
:mod:`tfmigrate.analysis.devices` and :mod:`tfmigrate.cst.names` and never import ``rules/`` or ``verify/``."""
