"""The `tfmigrate` command line: `main` (check, rules, explain, and the app) and `fix`."""
