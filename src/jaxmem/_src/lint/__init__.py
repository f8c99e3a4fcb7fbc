"""jaxmem.lint: memory settings that do nothing, found in a traced and compiled program."""
