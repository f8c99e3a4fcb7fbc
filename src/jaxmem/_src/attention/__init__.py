"""Memory-efficient attention: :func:`jaxmem.attention`."""
