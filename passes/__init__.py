"""FX graph passes (installed as `kvq_compile.passes`)."""
