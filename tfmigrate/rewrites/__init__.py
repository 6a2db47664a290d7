"""Rewrite families: code that turns a finding into an Edit. They read the tree through
:mod:`tfmigrate.devices` and :mod:`tfmigrate.names` and never import ``rules/`` or ``verify/``."""
