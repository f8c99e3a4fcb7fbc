"""jaxmem.scan: step analysis, the min-cut plan, checkpoint schedules, the custom VJP."""
