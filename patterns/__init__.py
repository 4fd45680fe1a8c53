"""Built-in fusion patterns."""
