"""fusegraph."""
