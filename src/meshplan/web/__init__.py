"""`meshplan web`: a local page over the planner, and `--html` self-contained reports (issue #17)."""
