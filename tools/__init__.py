"""Maintainer tools that check dostune's performance model against measurements: not part of the installed package.
Run them from the repository root, e.g. ``python -m tools.validation_report runs/gpu/validate-*/tune.json``."""
