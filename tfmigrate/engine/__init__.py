"""The engine: finds files, runs the rules over them (check and fix), caches and reports results.

It knows the rules only through the registry (discovered by name, never imported here)."""
