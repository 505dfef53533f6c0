"""Atomic components. Each module registers its component(s) by name; specs refer to them by that name."""
