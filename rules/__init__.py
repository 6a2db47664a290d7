"""The rule catalog: one module per rule, discovered by ``tfmigrate.registry``."""
