"""Private implementation of jaxmem. Import from :mod:`jaxmem` instead."""
