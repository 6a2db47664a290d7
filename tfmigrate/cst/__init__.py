"""The CST toolkit: read-only traversal, the rule walker, import-aware names, call arguments and
codegen. It imports nothing else from tfmigrate."""
