"""NKI codegen."""
