"""Analysis shared by rules and rewrites: device scopes, tower loops, batch splits (read only)."""
