"""jaxmem.optimize: the lean scan for programs written with ``lax.scan``, unchanged."""
