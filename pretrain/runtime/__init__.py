"""Runtime wing: launch variables, preflight checks, process groups, status.json, watchdog, stragglers, rank agreement."""
